"""Pure token-level layout: windows over long documents, packing, QA windows that keep the evidence.

Conventions of every row (see data/README.md):
- `labels` are NOT shifted (the HF layer shifts them before sharding); -100 means no loss.
- `position_ids` restart at 0 for every document segment of a row; `cu_seqlens` are the segment
  boundaries ([0, len] for one segment); `longdoc train` masks packed documents from them.
- Overlapping windows mask the tokens an earlier window already scored, so each document token is
  scored exactly once however the windows overlap.
"""

from __future__ import annotations

import random
from typing import Any

IGNORE = -100


def split_windows(n: int, target: int, overlap: int) -> list[tuple[int, int, int]]:
    """(start, end, loss_from) windows of `target` tokens over [0, n), consecutive ones overlapping by
    at least `overlap`; tokens before `loss_from` were scored by an earlier window."""
    if not 0 <= overlap < target:
        raise ValueError(f"overlap must be in [0, target) = [0, {target}), got {overlap}")
    if n <= target:
        return [(0, n, 0)]
    starts = list(range(0, n - target, target - overlap)) + [n - target]
    out, covered = [], 0
    for s in starts:
        out.append((s, s + target, max(s, covered)))
        covered = s + target
    return out


def segment_row(ids: list[int], labels: list[int], doc_id: str, source: str, start: int) -> dict[str, Any]:
    return {"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids))),
            "cu_seqlens": [0, len(ids)], "doc_ids": [doc_id], "sources": [source], "token_starts": [start]}


def pretrain_rows(ids: list[int], target: int, overlap: int, doc_id: str, source: str) -> list[dict[str, Any]]:
    rows = []
    for s, e, loss_from in split_windows(len(ids), target, overlap):
        window = ids[s:e]
        labels = [IGNORE] * (loss_from - s) + window[loss_from - s:]
        rows.append(segment_row(window, labels, doc_id, source, s))
    return rows


def pack_rows(rows: list[dict[str, Any]], target: int, extend: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Greedily concatenate rows shorter than `target` (in order) into rows of at most `target` tokens;
    the per-document list columns (doc_ids, sources, token_starts and those named in `extend`) concatenate."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for row in rows:
        n = len(row["input_ids"])
        if cur is not None and len(cur["input_ids"]) + n <= target:
            base = len(cur["input_ids"])
            cur["input_ids"] += row["input_ids"]
            # The first token of a later document must not be predicted from the previous document.
            cur["labels"] += [IGNORE] + row["labels"][1:]
            cur["position_ids"] += row["position_ids"]
            cur["cu_seqlens"].append(base + n)
            for key in ("doc_ids", "sources", "token_starts") + extend:
                cur[key] += row[key]
            continue
        if cur is not None:
            out.append(cur)
        cur = {k: list(v) for k, v in row.items()} if n < target else None
        if cur is None:
            out.append(row)
    if cur is not None:
        out.append(cur)
    return out


def evidence_pieces(n: int, budget: int, spans: list[tuple[int, int]], rng: random.Random,
                    sep_len: int) -> list[tuple[int, int]]:
    """Token ranges of a document to show within `budget` tokens, containing every evidence span.

    One contiguous window when the spans fit in it (placed at a random offset, so evidence is not
    always at the same depth); otherwise one piece around each group of spans, joined by a separator
    of `sep_len` tokens, in document order."""
    if budget <= 0:
        raise ValueError(f"no room for the document: the prompt and answer alone take the whole target "
                         f"({-budget} tokens too many); raise --target-tokens")
    if n <= budget:
        return [(0, n)]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if hi - lo <= budget:
        start = rng.randint(max(0, hi - budget), min(lo, n - budget))
        return [(start, start + budget)]
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    need = sum(b - a for a, b in merged) + sep_len * (len(merged) - 1)
    if need > budget:
        raise ValueError(f"the evidence needs {need} tokens but only {budget} fit next to the prompt; "
                         "raise --target-tokens")
    ctx = (budget - need) // (2 * len(merged))
    pieces: list[list[int]] = []
    for a, b in merged:
        a, b = max(0, a - ctx), min(n, b + ctx)
        if pieces and a <= pieces[-1][1] + sep_len:
            pieces[-1][1] = b
        else:
            pieces.append([a, b])
    return [(a, b) for a, b in pieces]


def qa_turns_row(prefix: list[int], doc: list[int], pieces: list[tuple[int, int]], sep: list[int],
                 turns: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of prompt + document pieces + (question, answer) turns; loss on every answer."""
    body: list[int] = []
    for i, (a, b) in enumerate(pieces):
        body += (sep if i else []) + doc[a:b]
    ids = prefix + body
    labels = [IGNORE] * len(ids)
    for prompt, answer in turns:
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
    return ids, labels
