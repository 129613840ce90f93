"""Running the RULER-style suite on CP ranks: batched prefill and sharded-KV greedy decoding, RULER's scoring.

Every (task, length) cell's prompts have exactly the same number of tokens (longdoc.eval.ruler.build), so
a cell runs in batches of --batch-size prompts with no padding: one CP prefill of the batch, then greedy
decoding of every row at once until each has stopped or used the task's answer budget. All ranks generate
the same prompts from the seed (the KV session checks they agree) and decode in lock-step; rank 0's
choice of each token is every rank's.
"""

from __future__ import annotations

import hashlib
import re
import time
from array import array
from typing import Any

import torch

from longdoc.corpus.ingest import Skips
from longdoc.eval import data, metrics, runner
from longdoc.eval.prompts import Prompter
from longdoc.eval.ruler.build import Builder, TooShort
from longdoc.eval.ruler.generate import (
    BATCH_TOKENS,
    DEFAULT_LENGTHS,
    DEFAULT_SAMPLES,
    HAYSTACKS,
    MIN_LENGTH,
    TASKS,
    Sample,
    document_haystack,
    make,
)
from longdoc.eval.ruler.report import write_report
from longdoc.hf.session import KVSession
from longdoc.parallel.api import ContextParallel

__all__ = ["check", "evaluate", "score", "summarize", "task", "write_report"]
_CONTROL = re.compile(r"[\x00-\x1f]")


def task_names(value: Any) -> list[str]:
    """--ruler-tasks as a list ("all", a comma-separated string or a list), each name checked."""
    if value in (None, "", "all"):
        return list(TASKS)
    names = [t.strip() for t in (value.split(",") if isinstance(value, str) else value) if str(t).strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ValueError(f"--ruler-tasks: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from "
                         f"{', '.join(TASKS)} (or all)")
    return list(dict.fromkeys(names))


def batch_size(cfg: dict[str, Any], length: int) -> int:
    value = cfg.get("batch_size") or "auto"
    if value == "auto":
        return max(1, min(16, BATCH_TOKENS // length))
    return int(value)


def check(cfg: dict[str, Any]) -> None:
    """Fail fast, before any rank starts, on bad settings."""
    task_names(cfg.get("ruler_tasks"))
    lengths = cfg.get("lengths") or DEFAULT_LENGTHS
    if min(lengths) < MIN_LENGTH:
        raise ValueError(f"--lengths must be at least {MIN_LENGTH} tokens for the RULER-style tasks, got {lengths}")
    if int(cfg.get("samples") or DEFAULT_SAMPLES) < 1:
        raise ValueError(f"--samples must be >= 1, got {cfg.get('samples')}")
    if cfg.get("haystack"):
        data.check_inputs(cfg["haystack"], "--haystack", skips=Skips() if cfg.get("skip_bad") else None)
    elif (cfg.get("ruler_haystack") or "prose") not in HAYSTACKS:
        raise ValueError(f"--ruler-haystack must be one of {', '.join(HAYSTACKS)}, got {cfg.get('ruler_haystack')!r}")
    b = cfg.get("batch_size") or "auto"
    if b != "auto" and (not str(b).isdigit() or int(b) < 1):
        raise ValueError(f"--batch-size must be auto or an integer >= 1, got {b!r}")


def score(prediction: str, references: list[str], metric: str) -> float:
    """RULER's string match: "all" = the fraction of references found in the prediction, "part" = 1 when any
    is (case-insensitive substring, after RULER's clean-up of control characters)."""
    pred = _CONTROL.sub("\n", prediction).strip().lower()
    hits = [r.lower() in pred for r in references]
    if metric == "all":
        return sum(hits) / len(hits)
    return float(any(hits))


# Generated prompts, so `eval compare` builds them once for both models (up to a memory bound).
_CACHE: dict[tuple, tuple[array, Sample]] = {}
_CACHE_TOKENS = 32 * 2**20
_cached = [0]  # tokens held


def _fingerprint(tokenizer: Any, chat: bool) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    text = repr((vocab, chat, getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token))
    return hashlib.sha1(text.encode()).hexdigest()


def _sample(builder: Builder, fp: str, task: str, length: int, index: int, seed: int, haystack: str
            ) -> tuple[array, Sample]:
    key = (fp, task, length, index, seed, haystack)
    try:
        s = make(task, length, index, seed=seed, haystack=haystack, builder=builder) if key not in _CACHE else None
    except TooShort as e:
        raise runner.EvalInputError(f"--lengths {length} is too short for the ruler task {task}: {e}; use longer "
                                    f"--lengths") from None
    if s is None:
        return _CACHE[key]
    entry = (array("i", s.ids), Sample([], s.references, s.query, s.depths))
    if _cached[0] + len(s.ids) <= _CACHE_TOKENS:
        _CACHE[key] = entry
        _cached[0] += len(s.ids)
    return entry


def evaluate(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The score grid and per-sample rows (identical on every rank)."""
    from tqdm.auto import tqdm

    names, lengths = task_names(cfg.get("ruler_tasks")), list(cfg.get("lengths") or DEFAULT_LENGTHS)
    n, seed = int(cfg.get("samples") or DEFAULT_SAMPLES), int(cfg.get("seed", 0))
    haystack, skips = cfg.get("ruler_haystack") or "prose", None
    if cfg.get("haystack"):  # the user's own documents (every rank reads them: samples are built on each)
        skips = Skips() if cfg.get("skip_bad") else None
        haystack = document_haystack(data.read_texts(cfg["haystack"], skips=skips))
    builder = Builder(tokenizer, chat=cfg.get("chat"))
    for length in lengths:  # every length against the model's context before any compute
        runner.check_context(model, length, f"--lengths {length} (a ruler prompt and its answer budget)")
    stops = Prompter(tokenizer, chat=builder.chat).stop_ids()
    device = next(model.parameters()).device
    fp = _fingerprint(tokenizer, builder.chat)
    for length in lengths:  # a length too short for a task fails now, not an hour into the run
        for name in names:
            _sample(builder, fp, name, length, 0, seed, haystack)
    rows: list[dict[str, Any]] = []
    seconds: dict[str, dict[str, float]] = {t: {} for t in names}
    bar = tqdm(total=len(names) * len(lengths) * n, desc="ruler", unit="sample", disable=cp.rank != 0,
               dynamic_ncols=True)
    for length in lengths:
        for name in names:
            spec, started, size = TASKS[name], time.time(), batch_size(cfg, length)
            for first in range(0, n, size):
                batch = [_sample(builder, fp, name, length, i, seed, haystack)
                         for i in range(first, min(n, first + size))]
                ids = torch.tensor([list(x) for x, _ in batch], dtype=torch.long, device=device)
                with KVSession(model, cp, strategy=cfg.get("strategy", "ring")) as session:
                    gen = session.greedy(session.prefill(ids), spec.max_new_tokens, eos_token_id=stops)
                for i, ((_, s), tokens) in enumerate(zip(batch, gen.tokens.tolist())):
                    cut = next((k for k, t in enumerate(tokens) if t in stops), len(tokens))
                    prediction = tokenizer.decode(tokens[:cut], skip_special_tokens=True)
                    rows.append({"task": name, "length": length, "index": first + i, "query": s.query,
                                 "references": s.references, "depth": s.depths[0] if s.depths else None,
                                 "depths": s.depths, "prompt_tokens": ids.shape[1], "prediction": prediction,
                                 "score": score(prediction, s.references, spec.metric)})
                bar.update(len(batch))
            seconds[name][str(length)] = time.time() - started
            cell = [r["score"] for r in rows if r["task"] == name and r["length"] == length]
            bar.set_postfix({name: f"{metrics.mean(cell):.2f}"})
    bar.close()
    result = {"task": "ruler", **summarize(rows, names, lengths), "samples": n, "seed": seed, "haystack": haystack,
              "chat": builder.chat, "metrics": {t: TASKS[t].metric for t in names},
              "max_new_tokens": {t: TASKS[t].max_new_tokens for t in names}, "cell_seconds": seconds, "rows": rows}
    if skips is not None:
        result["skipped"] = data.skipped(skips, "--haystack")
    return result


def summarize(rows: list[dict[str, Any]], names: list[str], lengths: list[int]) -> dict[str, Any]:
    """grid[task][length] means, the per-length average over tasks (RULER's headline) and the overall mean."""
    def mean(keep) -> float | None:
        vals = [r["score"] for r in rows if keep(r)]
        return metrics.mean(vals) if vals else None

    grid = [[mean(lambda r, t=t, L=L: r["task"] == t and r["length"] == L) for L in lengths] for t in names]
    average = [mean(lambda r, L=L: r["length"] == L) for L in lengths]
    return {"tasks": names, "lengths": lengths, "grid": grid, "average": average, "overall": mean(lambda r: True)}


def task(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `longdoc eval ruler` task (see longdoc.eval.runner)."""
    return evaluate(model, tokenizer, cp, cfg)
