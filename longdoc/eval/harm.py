"""The no-harm judge of `longdoc eval guard`: pair two runs item by item, bound each difference, decide.

Both models saw the same items, so the differences pair (longdoc.eval.compare.paired_bootstrap: the mean of
tuned minus base and its 95% percentile bootstrap interval, 10,000 resamples, fixed seed):
  - needle: cell by cell, the same haystack, length, depth, repeat, sentence and planted value; 1 correct, 0 not;
    the bootstrap resamples whole sentences (every cell of one needle sentence together: a model that misreads
    one sentence misreads it at every depth, so its cells are not independent, and a verdict on retrieval must
    not hinge on one sentence);
  - plain-text loss: window by window and position bucket by position bucket (the mean loss of one bucket of one
    window of the held-out text); the interval of the loss difference is divided by the base's mean loss, so it
    reads as a relative increase. Buckets rather than whole windows because a short text has one or two windows,
    and an interval over two items says nothing; neighbouring buckets of one window are not independent, so this
    interval is somewhat narrower than the truth, which the tolerance absorbs;
  - ruler (optional): sample by sample (compare's pairing: same task, length, index and expected answers).

The rule: a metric is HARM when its interval lies entirely on the harmful side and the harm is beyond the stated
tolerance:
  - needle and ruler accuracy: the upper bound of the delta is below 0 (the drop is real) and the drop itself is
    larger than --needle-tolerance (default 0.05, absolute accuracy);
  - plain-text loss: even the lower bound of the relative increase is above --loss-tolerance (default 0.02: 2%).
The verdict is HARM when any metric is, NO HARM otherwise (an interval that holds 0, or a drop within tolerance).
An item of one side without a twin on the other (another seed, text or grid) is an error, never dropped.
(longdoc.eval.compare, which draws with matplotlib, is imported where it is used: `longdoc --help` reads the
tolerances and the rule from here.)
"""

from __future__ import annotations

import math
from typing import Any

NEEDLE_TOLERANCE = 0.05
LOSS_TOLERANCE = 0.02
RULE = (f"HARM when a paired 95% bootstrap interval lies entirely on the harmful side beyond the tolerance: needle "
        f"(and ruler) accuracy, the delta's upper bound < 0 and the drop > --needle-tolerance (default "
        f"{NEEDLE_TOLERANCE}); plain-text loss, the relative increase's lower bound > --loss-tolerance (default "
        f"{LOSS_TOLERANCE}, i.e. {LOSS_TOLERANCE:.0%}). Otherwise NO HARM")
LABELS = {"needle": "needle", "position-loss": "plain-text loss", "ruler": "ruler"}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _strict(what: str, n: int, unpaired: int) -> None:
    if unpaired or not n:
        raise ValueError(f"cannot pair the two runs: {unpaired} {what} have no twin on the other side ({n} paired; "
                         f"another --text, --seed or grid); run both with the same settings, or name the base model "
                         f"instead of its run folder to evaluate it again")


def needle_pairs(base: dict[str, Any], tuned: dict[str, Any]) -> tuple[list[float], list[float], list[str]]:
    """(base, tuned) correctness per needle cell, paired by length, depth, repeat, question and the planted value,
    and each cell's question (the bootstrap's cluster: the cells of one needle sentence go together)."""
    def key(c: dict) -> tuple:
        return c["length"], c["depth"], c["repeat"], c["question"], c["answer"]

    twins = {key(c): c for c in base["cells"]}
    pairs = [(float(twins[key(c)]["correct"]), float(c["correct"]), c["question"]) for c in tuned["cells"]
             if key(c) in twins]
    _strict("needle cells", len(pairs), len(base["cells"]) + len(tuned["cells"]) - 2 * len(pairs))
    return [a for a, _, _ in pairs], [b for _, b, _ in pairs], [q for _, _, q in pairs]


def loss_pairs(base: dict[str, Any], tuned: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(base, tuned) mean loss per window and position bucket, windows paired by the hash of their tokens."""
    for side, r in (("base", base), ("tuned", tuned)):
        if "per_document" not in r:
            raise ValueError(f"the {side} position-loss run has no per-document losses (written before longdoc "
                             f"kept them); evaluate it again")
    pb, pt = base["per_document"], tuned["per_document"]
    twins = dict(zip(pb["keys"], pb["bucket_loss"]))
    a: list[float] = []
    b: list[float] = []
    paired = 0
    for k, row in zip(pt["keys"], pt["bucket_loss"]):
        if k not in twins:
            continue
        paired += 1
        for x, y in zip(twins[k], row):
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                a.append(x)
                b.append(y)
    _strict("plain-text windows", paired, len(pb["keys"]) + len(pt["keys"]) - 2 * paired)
    return a, b


def ruler_pairs(base: dict[str, Any], tuned: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(base, tuned) score per RULER-style sample, paired as `eval compare` pairs them."""
    from longdoc.eval.compare import _ruler_pairs

    pairs, unpaired = _ruler_pairs(base, tuned)
    _strict("ruler samples", len(pairs), unpaired + len(tuned.get("rows") or []) - len(pairs))
    return [x["score"] for x, _ in pairs], [y["score"] for _, y in pairs]


def judge_accuracy(a: list[float], b: list[float], tolerance: float, groups: list[str] | None = None
                   ) -> dict[str, Any]:
    """Accuracy (higher is better): HARM when the delta's upper bound is below 0 and the drop exceeds `tolerance`.
    `groups`: the items' clusters, resampled whole (needle cells by sentence)."""
    from longdoc.eval.compare import paired_bootstrap

    p = paired_bootstrap(a, b, groups=groups)
    harm = p["n"] > 0 and p["high"] < 0 and -p["delta"] > tolerance
    return {"kind": "accuracy", "base": _mean(a), "tuned": _mean(b), "delta": p["delta"], "low": p["low"],
            "high": p["high"], "n": p["n"], "tolerance": tolerance, "harm": bool(harm), "paired": p}


def judge_loss(a: list[float], b: list[float], tolerance: float) -> dict[str, Any]:
    """Loss (lower is better), as a relative change of the base's mean: HARM when even the interval's lower bound
    is an increase beyond `tolerance`."""
    from longdoc.eval.compare import paired_bootstrap

    p = paired_bootstrap(a, b)
    base = _mean(a)
    scale = base if base else float("nan")
    rel = {k: None if p[k] is None else p[k] / scale for k in ("delta", "low", "high")}
    harm = p["n"] > 0 and rel["low"] is not None and rel["low"] > tolerance
    return {"kind": "loss", "base": base, "tuned": _mean(b), "delta": rel["delta"], "low": rel["low"],
            "high": rel["high"], "n": p["n"], "tolerance": tolerance, "harm": bool(harm), "paired": p}


def judge(runs: dict[str, tuple[dict[str, Any], dict[str, Any]]], needle_tolerance: float = NEEDLE_TOLERANCE,
          loss_tolerance: float = LOSS_TOLERANCE) -> dict[str, Any]:
    """The verdict over the (base, tuned) results of each task run ("needle", "position-loss", "ruler")."""
    metrics: dict[str, dict[str, Any]] = {}
    if "needle" in runs:
        a, b, questions = needle_pairs(*runs["needle"])
        metrics["needle"] = judge_accuracy(a, b, needle_tolerance, groups=questions)
    if "position-loss" in runs:
        metrics["position-loss"] = judge_loss(*loss_pairs(*runs["position-loss"]), loss_tolerance)
    if "ruler" in runs:
        metrics["ruler"] = judge_accuracy(*ruler_pairs(*runs["ruler"]), needle_tolerance)
    if not metrics:
        raise ValueError(f"nothing to judge: give the runs of one of {', '.join(LABELS)}")
    verdict = "HARM" if any(m["harm"] for m in metrics.values()) else "NO HARM"
    result = {"metrics": metrics, "verdict": verdict, "rule": RULE}
    result["line"] = verdict_line(result)
    return result


def describe(name: str, m: dict[str, Any]) -> str:
    """One metric as the verdict line shows it, e.g. `needle 0.60 -> 0.57, delta -0.03 [-0.13, +0.07]`."""
    if m["n"] == 0:
        return f"{LABELS[name]}: no pairs"
    if m["kind"] == "loss":
        text = f"{LABELS[name]} {m['delta']:+.1%} [{m['low']:+.1%}, {m['high']:+.1%}]"
        return text + (f" beyond the {m['tolerance']:.1%} tolerance" if m["harm"] else "")
    text = f"{LABELS[name]} {m['base']:.2f} -> {m['tuned']:.2f}, delta {m['delta']:+.2f} [{m['low']:+.2f}, " \
           f"{m['high']:+.2f}]"
    return text + (f" beyond the {m['tolerance']:.2f} tolerance" if m["harm"] else "")


def verdict_line(judged: dict[str, Any]) -> str:
    """The one line `eval guard` ends with: `guard: NO HARM (needle ...; plain-text loss ...)`."""
    parts = "; ".join(describe(name, m) for name, m in judged["metrics"].items())
    return f"guard: {judged['verdict']} ({parts})"
