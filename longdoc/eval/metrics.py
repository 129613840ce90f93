"""Answer metrics as in SQuAD / LongBench, and breakdowns of per-question results.

Normalization (SQuAD's `normalize_answer`, which LongBench's `qa_f1_score` also uses): lowercase,
drop punctuation, drop the articles "a", "an", "the", collapse whitespace (any run of whitespace, line breaks
of hard-wrapped text included, is one space; zero-width spaces separate words, soft hyphens and other invisible
format characters are dropped, as text copied from PDFs holds them). Exact match compares the
normalized strings; token F1 is the harmonic mean of precision and recall of the normalized
whitespace tokens (multiset overlap). With several gold answers (an answer and its aliases) the best
score over them counts.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# zero-width space -> a word break; soft hyphen, zero-width (non-)joiner, word joiner, BOM -> nothing
_INVISIBLE = str.maketrans({"\u200b": " ", "\u00ad": None, "\u200c": None, "\u200d": None, "\u2060": None,
                            "\ufeff": None})


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and articles, collapse whitespace."""
    text = text.translate(_INVISIBLE).lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 when the normalized prediction equals a normalized gold answer, else 0.0."""
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        # Both empty (e.g. the answer was only an article) is agreement; one empty is not.
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Best token-level F1 of the normalized prediction against the normalized gold answers."""
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = normalize_answer(prediction).split()
    return max((_f1(pred, normalize_answer(g).split()) for g in golds), default=0.0)


def contains_answer(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 when a normalized gold answer occurs in the normalized prediction as whole words."""
    golds = [gold] if isinstance(gold, str) else list(gold)
    pred = f" {normalize_answer(prediction)} "
    return float(any(normalize_answer(g) and f" {normalize_answer(g)} " in pred for g in golds))


def depth_bucket(depth: float, buckets: int = 5) -> str:
    """'0.0-0.2', ... for an evidence depth in [0, 1] (1 falls in the last bucket)."""
    i = min(int(depth * buckets), buckets - 1) if depth == depth else 0
    return f"{i / buckets:.1f}-{(i + 1) / buckets:.1f}"


def length_bucket(num_tokens: int) -> str:
    """The document length rounded to a power-of-two number of k-tokens: 2k, 4k, 32k, ..."""
    if num_tokens < 1024:
        return f"{num_tokens}"
    return f"{2 ** round(math.log2(num_tokens / 1024))}k"


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


METRIC_KEYS = ("em", "f1", "contains", "nll_per_token", "tf_em")


def summarize(rows: Sequence[dict[str, Any]], keys: Sequence[str] = METRIC_KEYS) -> dict[str, Any]:
    """Mean of each metric over `rows` (rows missing a key are skipped for it), plus the count."""
    out: dict[str, Any] = {"n": len(rows)}
    for k in keys:
        vals = [float(r[k]) for r in rows if r.get(k) is not None]
        if vals:
            out[k] = mean(vals)
    return out


def breakdown(rows: Sequence[dict[str, Any]], by: Callable[[dict[str, Any]], str],
              keys: Sequence[str] = METRIC_KEYS) -> dict[str, dict[str, Any]]:
    """`summarize` per group, groups in sorted order (lengths numerically)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(by(r), []).append(r)
    return {g: summarize(groups[g], keys) for g in sorted(groups, key=_sort_key)}


def _sort_key(label: str) -> tuple:
    m = re.match(r"^(\d+(?:\.\d+)?)(k?)", label)
    if m:
        return (0, float(m.group(1)) * (1024 if m.group(2) else 1), label)
    return (1, 0.0, label)
