"""Run folders: one per evaluation run, holding results.json, summary.md and the PNGs.

    runs/eval/qa-SmolLM2-135M-Instruct-20250101-120000/
        results.json    every number (per question / per cell / per bucket) and the run's settings
        summary.md      the tables a person reads
        *.png           plots, drawn from results.json as written

Every file is written atomically (a temporary file in the same folder, then a rename), so a reader
never sees half a file and a crashed run leaves no truncated results.json behind.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longdoc.io import atomic_write, atomic_write_text

RESULTS = "results.json"
SUMMARY = "summary.md"


def default_run_dir(task: str, model: str, root: str | os.PathLike = "runs/eval") -> Path:
    """runs/eval/<task>-<model slug>-<UTC timestamp>."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model.rstrip("/")).name or model).strip("-") or "model"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(root) / f"{task}-{slug}-{stamp}"


def write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_text(path, text)


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write null, so every reader (jq, JavaScript, pandas) can parse the file.
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_text(path, json.dumps(_clean(data), indent=2, ensure_ascii=False) + "\n")


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically as PNG and close it."""
    import matplotlib.pyplot as plt

    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    finally:
        plt.close(fig)


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """results.json of a run folder (or the file itself)."""
    p = Path(path)
    f = p / RESULTS if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{p} is not an evaluation run folder (no {RESULTS}); run `longdoc eval qa|needle|"
                                f"position-loss` first, or pass the folder it printed")
    return json.loads(f.read_text(encoding="utf-8"))


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v, digits) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def run_header(title: str, results: dict[str, Any]) -> str:
    cfg = results.get("config", {})
    bits = [f"# {title}", "", f"- model: `{results.get('model', '?')}`",
            f"- context parallel: {cfg.get('cp', 1)} rank(s), layout {cfg.get('layout', 'zigzag')}, "
            f"dtype {cfg.get('dtype', '?')}", f"- finished: {results.get('finished', '?')}"]
    if results.get("seconds") is not None:
        bits.append(f"- wall time: {results['seconds']:.0f} s")
    return "\n".join(bits) + "\n"


def headline(results: dict) -> str:
    """One line of a task's results, the numbers a user looks for first (`longdoc eval` prints it)."""
    task = results.get("task")
    if "summary" in results and "overall" in results["summary"]:  # qa
        o = results["summary"]["overall"]
        parts = [f"{label} {fmt(o.get(k), 3)}" for k, label in (("em", "EM"), ("f1", "F1"), ("contains", "contains"),
                                                              ("nll_per_token", "answer NLL/token")) if k in o]
        skipped = f"; {results['skipped']['summary']}" if results.get("skipped") else ""  # --skip-bad
        return f"qa: {', '.join(parts)} over {o.get('n', '?')} questions{skipped}"
    # --skip-bad on --haystack: what it left out, each item listed after the headline (longdoc.eval.cli)
    haystack = f"; --haystack {results['skipped']['summary']}" if isinstance(results.get("skipped"), dict) else ""
    if "mean_accuracy" in results:  # needle
        return (f"needle: mean accuracy {fmt(results['mean_accuracy'], 3)} over {len(results.get('cells', []))} "
                f"cells{haystack}")
    if task == "ruler":
        per_length = ", ".join(f"{n}: {fmt(v, 3)}" for n, v in zip(results["lengths"], results["average"]))
        return (f"ruler: average {fmt(results.get('overall'), 3)} over {len(results['tasks'])} tasks x "
                f"{results['samples']} samples (by length {per_length}){haystack}")
    if "mean_loss" in results:  # position-loss
        return (f"position-loss: mean loss {fmt(results.get('overall'))} nats per token over "
                f"{results.get('documents', '?')} document(s) of {results.get('length', '?')} tokens; first bucket "
                f"{fmt(results.get('first_bucket'))}, last {fmt(results.get('last_bucket'))}")
    if task == "chat-loss":
        skipped = f"; {len(results['skipped'])} did not fit --length" if results.get("skipped") else ""
        return (f"chat-loss: mean loss {fmt(results.get('overall'))} nats per {results.get('loss_on')} token over "
                f"{results.get('conversations')} conversation(s), {results.get('tokens')} tokens{skipped}")
    return f"{task}: done"
