"""`longdoc eval compare A B`: two models (or two finished runs) side by side - tables and plots.

A and B are each either a run folder (results.json), a folder of run folders (one per task, as this
command writes them), or a model to evaluate now with --tasks (default qa, needle, position-loss; ruler
on request):

    longdoc eval compare SmolLM2-135M-Instruct runs/demo/final --names base tuned \
        --data heldout.jsonl --lengths 1k,2k --cp 2 --out runs/eval/demo-compare

writes runs/eval/demo-compare/{base,tuned}/<task>/ (each a normal run folder) and, at the top,
results.json, summary.md and compare_*.png for the tasks both sides have. Loss by position runs over
the --data documents unless --pl-data (or --length, to generate documents) says otherwise.

QA differences come with a paired bootstrap confidence interval: both sides answered the same questions,
so the per-question differences are resampled (questions drawn with replacement) and the 2.5th and
97.5th percentiles of their mean bound the difference. A difference whose interval holds 0 is marked
"within noise": the questions asked cannot tell the two models apart on that metric. RULER-style
differences pair the same way, sample by sample (same task, length, index and expected answers), per
task, per length and per task and length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longdoc.eval import data as inputs
from longdoc.eval import plots, report, tasks

_QA_METRICS = [("em", "EM"), ("f1", "F1"), ("contains", "contains"), ("nll_per_token", "NLL/token"),
               ("tf_em", "TF-EM")]
BOOTSTRAP_SAMPLES = 10_000
CI_LEVEL = 0.95


def paired_bootstrap(a: Sequence[float], b: Sequence[float], samples: int = BOOTSTRAP_SAMPLES, level: float = CI_LEVEL,
                     seed: int = 0, groups: Sequence[Any] | None = None) -> dict[str, Any]:
    """Mean of b[i] - a[i] and its percentile bootstrap interval over the paired items (fixed seed: the same
    runs always give the same interval). `noise`: the interval holds 0. With `groups` (one label per item), whole
    groups are resampled (a cluster bootstrap: items of one group, e.g. needle cells of one sentence, are not
    independent), and each resample's delta is the mean over the items of the groups drawn."""
    import numpy as np

    if len(a) != len(b) or (groups is not None and len(groups) != len(a)):
        raise ValueError(f"paired_bootstrap: {len(a)} values against {len(b)}"
                         f"{'' if groups is None else f' and {len(groups)} group labels'}; pair the same items")
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    if d.size == 0:
        return {"n": 0, "delta": None, "low": None, "high": None, "level": level, "noise": None}
    rng = np.random.default_rng(seed)
    if groups is None:
        means = d[rng.integers(0, d.size, size=(samples, d.size))].mean(axis=1)
    else:
        labels = {g: k for k, g in enumerate(dict.fromkeys(groups))}
        index = np.asarray([labels[g] for g in groups])
        sums, counts = np.bincount(index, weights=d), np.bincount(index).astype(np.float64)
        draws = rng.integers(0, len(labels), size=(samples, len(labels)))
        means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    low, high = (float(x) for x in np.quantile(means, [(1 - level) / 2, (1 + level) / 2]))
    out = {"n": int(d.size), "delta": float(d.mean()), "low": low, "high": high, "level": level,
           "noise": bool(low <= 0.0 <= high)}
    return out if groups is None else {**out, "groups": len(set(groups))}


def _paired(rows_a: list[dict], rows_b: list[dict], metric: str, keep=lambda r: True) -> dict[str, Any]:
    """paired_bootstrap of `metric` over the questions both sides answered (matched by document and id)."""
    def key(r: dict, i: int) -> tuple:
        return (r.get("doc_id"), r.get("qa_id") if r.get("qa_id") is not None else i)

    b = {key(r, i): r for i, r in enumerate(rows_b)}
    pairs = [(r[metric], b[k][metric]) for i, r in enumerate(rows_a) if keep(r)
             for k in [key(r, i)] if k in b and _finite(r.get(metric)) and _finite(b[k].get(metric))]
    return paired_bootstrap([x for x, _ in pairs], [y for _, y in pairs])


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ci(p: dict[str, Any] | None) -> str:
    if not p or p.get("low") is None:
        return "-"
    return f"[{p['low']:+.3f}, {p['high']:+.3f}]" + (" within noise" if p["noise"] else "")


def find_runs(path: str | Path) -> dict[str, Path] | None:
    """task -> run folder for a run folder or a folder of them; None when `path` is not one (a model)."""
    p = Path(path)
    if (p / report.RESULTS).is_file():
        return {report.load_results(p).get("task", "?"): p}
    if p.is_dir():
        subs = {}
        for child in sorted(p.iterdir()):
            if (child / report.RESULTS).is_file():
                subs[report.load_results(child).get("task", child.name)] = child
        return subs or None
    return None


def _names(cfg: dict[str, Any]) -> tuple[str, str]:
    if cfg.get("names"):
        return tuple(cfg["names"])  # type: ignore[return-value]
    a, b = (re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(x).rstrip("/")).name) or "model" for x in (cfg["a"], cfg["b"]))
    return (a, b) if a != b else ("A", "B")


def _wanted(cfg: dict[str, Any]) -> list[str]:
    wanted = [t.strip() for t in str(cfg.get("tasks", "")).split(",") if t.strip()]
    for t in wanted:
        tasks.module(t)  # validates the name
    if "qa" in wanted and not cfg.get("data"):
        raise ValueError("compare: the qa task needs --data FILE.jsonl (`longdoc data synth ...`); or leave it out "
                         "with --tasks needle,position-loss")
    if not wanted:
        raise ValueError("compare: --tasks is empty; choose from " + ", ".join(tasks.TASKS))
    return wanted


def _qa(a: dict, b: dict, names: tuple[str, str], out: Path) -> tuple[dict, list[str]]:
    sa, sb = a["summary"], b["summary"]
    rows_a, rows_b = a.get("rows") or [], b.get("rows") or []
    overall = {k: {"a": sa["overall"].get(k), "b": sb["overall"].get(k)} for k, _ in _QA_METRICS}
    paired = {k: _paired(rows_a, rows_b, k) for k, _ in _QA_METRICS} if rows_a and rows_b else {}
    level = f"{CI_LEVEL:.0%} CI"
    rows = [[label, overall[k]["a"], overall[k]["b"], _delta(overall[k]["a"], overall[k]["b"]), _ci(paired.get(k))]
            for k, label in _QA_METRICS]
    md = ["## Document QA\n", report.table(["metric", *names, "delta", f"{level} of the delta (paired bootstrap)"],
                                           rows), ""]
    if paired:
        n = paired["f1"]["n"]
        md += [f"{n} questions answered by both; {level}: {BOOTSTRAP_SAMPLES} resamples of the questions; "
               f"\"within noise\": the interval holds 0.", ""]
    data: dict[str, Any] = {"overall": overall, "paired": paired}
    for key, label, group in (("by_kind", "question kind", lambda r: r.get("kind")),
                              ("by_length", "document length", None), ("by_depth", "evidence depth", None)):
        groups = list(dict.fromkeys([*sa[key], *sb[key]]))
        data[key] = {g: {m: {"a": sa[key].get(g, {}).get(m), "b": sb[key].get(g, {}).get(m)} for m in ("em", "f1")}
                     for g in groups}
        if group is not None and paired:
            for g in groups:
                data[key][g]["f1_paired"] = _paired(rows_a, rows_b, "f1", keep=lambda r, g=g, by=group: by(r) == g)
        md += [f"### By {label}\n", report.table(
            [label, f"EM {names[0]}", f"EM {names[1]}", f"F1 {names[0]}", f"F1 {names[1]}", "F1 delta"]
            + ([f"{level}"] if group is not None and paired else []),
            [[g, d["em"]["a"], d["em"]["b"], d["f1"]["a"], d["f1"]["b"], _delta(d["f1"]["a"], d["f1"]["b"])]
             + ([_ci(d.get("f1_paired"))] if group is not None and paired else [])
             for g, d in data[key].items()]), ""]
    report.save_figure(plots.compare_qa_figure(sa, sb, names, "f1"), out / "compare_qa_f1.png")
    # The held-out answers' NLL per token (teacher forced, the training prompt): what the fine-tune optimized.
    report.save_figure(_nll_figure(sa, sb, names), out / "compare_qa_nll.png")
    md += ["![QA F1](compare_qa_f1.png)\n", "![held-out answer NLL per token](compare_qa_nll.png)\n"]
    return data, md


def _nll_figure(sa: dict, sb: dict, names: tuple[str, str]):
    # The QA figure's axes are scaled for scores in [0, 1]; an NLL in nats needs its own scale.
    fig = plots.compare_qa_figure(sa, sb, names, "nll_per_token")
    for ax in fig.axes:
        heights = [p.get_height() for p in ax.patches if math.isfinite(p.get_height())]
        ax.set_ylim(0, 1.15 * max(heights, default=1.0) or 1.0)
        ax.set_ylabel("NLL per answer token (nats)")
    fig.suptitle(f"Held-out answer NLL per token (teacher forced, lower is better): {names[0]} vs {names[1]}",
                 fontsize=11)
    return fig


def _ruler_lines(results: dict[str, Any]) -> list[str]:
    ruler = results.get("ruler")
    if not ruler:
        return []
    a, b = results["names"]
    lines = []
    for label, d in [*ruler["by_task"].items(), ("all tasks", ruler["overall"])]:
        p = d["paired"]
        if d["a"] is None or d["b"] is None:
            continue
        ci = (f", {p['level']:.0%} paired bootstrap CI [{p['low']:+.3f}, {p['high']:+.3f}] over {p['n']} samples"
              + (" - within noise" if p["noise"] else "") if p.get("low") is not None else "")
        lines.append(f"ruler {label}: {a} {d['a']:.3f}, {b} {d['b']:.3f}, delta {d['b'] - d['a']:+.3f}{ci}")
    return lines


def console_summary(results: dict[str, Any]) -> list[str]:
    """The lines `longdoc eval compare` prints: each QA metric and each RULER-style task of both sides, its delta
    and the interval; the needle grid's mean accuracy and the mean loss by position of both sides; then every
    input --skip-bad left out, by name."""
    a, b = results["names"]
    lines = []
    qa = results.get("qa") or {}
    for k, label in _QA_METRICS if qa else ():
        va, vb, p = qa["overall"][k]["a"], qa["overall"][k]["b"], qa.get("paired", {}).get(k)
        if va is None or vb is None:
            continue
        ci = (f", {p['level']:.0%} paired bootstrap CI [{p['low']:+.3f}, {p['high']:+.3f}] over {p['n']} questions"
              + (" - within noise" if p["noise"] else "") if p and p.get("low") is not None else "")
        lines.append(f"qa {label}: {a} {va:.3f}, {b} {vb:.3f}, delta {vb - va:+.3f}{ci}")
    for task, key, label in (("needle", "mean_accuracy", "mean accuracy"),
                             ("position-loss", "overall", "mean loss (nats/token)")):
        pair = (results.get(task) or {}).get(key) or {}
        if pair.get("a") is not None and pair.get("b") is not None:
            va, vb = pair["a"], pair["b"]
            lines.append(f"{task} {label}: {a} {va:.3f}, {b} {vb:.3f}, delta {vb - va:+.3f}")
    return lines + _ruler_lines(results) + list(results.get("skipped", []))


def _needle(a: dict, b: dict, names: tuple[str, str], out: Path) -> tuple[dict, list[str]]:
    data = {"mean_accuracy": {"a": a["mean_accuracy"], "b": b["mean_accuracy"]},
            "a": {k: a[k] for k in ("lengths", "depths", "accuracy")},
            "b": {k: b[k] for k in ("lengths", "depths", "accuracy")}}
    report.save_figure(plots.compare_needle_figure(a, b, names), out / "compare_needle.png")
    md = ["## Needle in a haystack\n",
          report.table(["", *names, "delta"], [["mean accuracy", a["mean_accuracy"], b["mean_accuracy"],
                                                _delta(a["mean_accuracy"], b["mean_accuracy"])]]), ""]
    from longdoc.eval.needle import grid_table

    md += [f"{names[0]}:\n", grid_table(a), "", f"{names[1]}:\n", grid_table(b), "", "![needle](compare_needle.png)\n"]
    return data, md


def _position(a: dict, b: dict, names: tuple[str, str], out: Path) -> tuple[dict, list[str]]:
    data = {k: {"a": a[k], "b": b[k]} for k in ("overall", "first_bucket", "last_bucket", "centers", "mean_loss")}
    report.save_figure(plots.position_figure([(names[0], a), (names[1], b)], title="Loss by position"),
                       out / "compare_position_loss.png")
    rows = [[label, a[k], b[k], _delta(a[k], b[k])] for k, label in
            (("overall", "mean loss"), ("first_bucket", "first bucket"), ("last_bucket", "last bucket"))]
    md = ["## Loss by position (nats, lower is better)\n", report.table(["", *names, "delta"], rows), "",
          "![loss by position](compare_position_loss.png)\n"]
    return data, md


def _delta(a: Any, b: Any) -> float | None:
    return None if a is None or b is None else b - a


def _ruler_pairs(a: dict, b: dict) -> tuple[list[tuple[dict, dict]], int]:
    """(row of a, row of b) for the samples both sides scored: the same task, length and index, and the same
    expected answers (another seed or tokenizer makes other samples, which do not pair); and the unpaired count."""
    rows_b = {(r["task"], r["length"], r["index"]): r for r in b.get("rows") or []}
    pairs, unpaired = [], 0
    for r in a.get("rows") or []:
        other = rows_b.get((r["task"], r["length"], r["index"]))
        if other is not None and other["references"] == r["references"]:
            pairs.append((r, other))
        else:
            unpaired += 1
    return pairs, unpaired


def _ruler(a: dict, b: dict, names: tuple[str, str], out: Path) -> tuple[dict, list[str]]:
    pairs, unpaired = _ruler_pairs(a, b)
    tasks = [t for t in a["tasks"] if t in b["tasks"]]
    lengths = [n for n in a["lengths"] if n in b["lengths"]]

    def side(keep) -> dict[str, Any]:
        kept = [(x, y) for x, y in pairs if keep(x)]
        p = paired_bootstrap([x["score"] for x, _ in kept], [y["score"] for _, y in kept])
        mean = (lambda v: sum(v) / len(v) if v else None)
        return {"a": mean([x["score"] for x, _ in kept]), "b": mean([y["score"] for _, y in kept]), "paired": p}

    data: dict[str, Any] = {
        "tasks": tasks, "lengths": lengths, "unpaired": unpaired, "overall": side(lambda r: True),
        "by_task": {t: side(lambda r, t=t: r["task"] == t) for t in tasks},
        "by_length": {str(n): side(lambda r, n=n: r["length"] == n) for n in lengths},
        "cells": {f"{t}@{n}": side(lambda r, t=t, n=n: r["task"] == t and r["length"] == n)
                  for t in tasks for n in lengths}}
    report.save_figure(plots.compare_ruler_figure(a, b, names), out / "compare_ruler.png")
    level = f"{CI_LEVEL:.0%} CI of the delta (paired bootstrap)"

    def row(label, d):
        return [label, d["a"], d["b"], _delta(d["a"], d["b"]), d["paired"]["n"], _ci(d["paired"])]

    header = ["", *names, "delta", "samples", level]
    md = ["## RULER-style suite\n",
          f"Pooled over the lengths {', '.join(map(str, lengths))}; every sample is scored by both models, so the "
          f"differences pair ({BOOTSTRAP_SAMPLES} resamples of the samples)."
          + (f" {unpaired} samples of {names[0]} have no twin in {names[1]} (another seed, tokenizer or length) "
             f"and are left out." if unpaired else "") + "\n",
          report.table(header, [row(t, data["by_task"][t]) for t in tasks] + [row("**all tasks**", data["overall"])]),
          "", "### By length (average over tasks)\n",
          report.table(header, [row(n, data["by_length"][n]) for n in data["by_length"]]), "",
          "### By task and length\n",
          report.table(header, [row(k.replace("@", " @ "), d) for k, d in data["cells"].items()]), "",
          "![RULER-style suite](compare_ruler.png)\n"]
    return data, md


_SECTIONS = {"qa": _qa, "needle": _needle, "position-loss": _position, "ruler": _ruler}


def write_comparison(runs_a: dict[str, Path], runs_b: dict[str, Path], names: tuple[str, str], out: Path) -> Path:
    """results.json, summary.md and compare_*.png in `out` for the tasks both sides have."""
    common = [t for t in _SECTIONS if t in runs_a and t in runs_b]
    if not common:
        raise ValueError(f"nothing to compare: {names[0]} has {sorted(runs_a)} and {names[1]} has {sorted(runs_b)}; "
                         f"both need runs of the same task")
    results: dict[str, Any] = {"task": "compare", "names": list(names),
                               "runs": {"a": {t: str(p) for t, p in runs_a.items()},
                                        "b": {t: str(p) for t, p in runs_b.items()}}}
    md = [f"# {names[0]} vs {names[1]}\n"]
    md += [f"- {n}: `{report.load_results(r[common[0]]).get('model', '?')}`" for n, r in zip(names, (runs_a, runs_b))]
    md.append("")
    left_out: dict[str, list[str]] = {}  # --skip-bad: each item once, with the tasks whose input it was in
    for t in common:
        ra, rb = report.load_results(runs_a[t]), report.load_results(runs_b[t])
        data, lines = _SECTIONS[t](ra, rb, names, out)
        results[t] = data
        md += lines
        for line in inputs.skipped_lines(ra) + inputs.skipped_lines(rb):
            if t not in left_out.setdefault(line, []):
                left_out[line].append(t)
    if left_out:
        results["skipped"] = [f"{line} ({', '.join(ts)})" for line, ts in left_out.items()]
        md += ["## Inputs left out (--skip-bad)\n", *(f"- {line}" for line in results["skipped"]), ""]
    report.write_json(out / report.RESULTS, results)
    report.write_text(out / report.SUMMARY, "\n".join(md) + "\n")
    return out


def main(cfg: dict[str, Any]) -> Path | None:
    """The `longdoc eval compare` command; returns the folder in the process that wrote it."""
    names = _names(cfg)
    if not cfg.get("pl_data") and cfg.get("data"):
        cfg = {**cfg, "pl_data": list(cfg["data"])}  # loss by position over the QA documents by default
    out = Path(cfg.get("out") or report.default_run_dir("compare", f"{names[0]}-vs-{names[1]}"))
    sides: list[dict[str, Path] | None] = [find_runs(cfg["a"]), find_runs(cfg["b"])]
    to_run = [(name, str(m)) for name, m, runs in zip(names, (cfg["a"], cfg["b"]), sides) if runs is None]
    if to_run:
        # Both models in one start of the ranks: each is loaded once and runs every task.
        done = tasks.run_suite(to_run, _wanted(cfg), cfg, out)
        if done is None:
            return None  # not rank 0: the folders are written there
        sides = [runs if runs is not None else done[name] for name, runs in zip(names, sides)]
    from longdoc.runtime.launch import launched_world

    if not launched_world().is_main:  # under a launcher only rank 0 writes the comparison
        return None
    written = write_comparison(sides[0], sides[1], names, out)
    for line in console_summary(report.load_results(written)):
        print(line, flush=True)
    return written
