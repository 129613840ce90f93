"""Attention patterns in global token positions, and the blocks a rank computes for them.

A `Pattern` says which key j a query i sees (all in GLOBAL positions of the full sequence, so every
rank computes the same thing):
- causal: j <= i (else any j of the same segment);
- window w (sliding window, Hugging Face's convention): i - w < j <= i;
- chunk_size C (Llama 4 chunked local attention): i // C == j // C, counted from each document's
  start in a packed row (what running every document on its own gives);
- documents (a packed row): i and j in the same document;
- branches (preference pairs packed as [prompt | chosen | rejected], layout.Branches): i and j in one pair, and
  not (i in rejected and j in chosen), so each sibling sees the shared prompt and itself but not the other.
Chunks and documents cut the sequence into *segments*; inside a segment, query i sees the keys j
with lo(i) <= j <= hi(i), where lo(i) = i - w + 1 (or the segment start) and hi(i) = i (or the
segment end). Both are non-decreasing in i, so the visible keys of a block of consecutive queries
form a band: a block is hidden, full, a causal square, or a band given by two diagonals. Only
band blocks need a mask, and it is built from the two diagonals by the kernel.

Branches give a rejected query two ranges of keys (the prompt, then rejected), which no band expresses. So each
pair's prompt, chosen and rejected are segments of their own, and a query segment sees, besides itself, the keys
of the segments `_key_segments` lists: chosen and rejected also see their pair's prompt. Every query segment x key
segment combination is then one of the kinds above (prompt keys are all before a sibling's queries: full blocks),
and rejected x chosen is simply never listed: no new kernel, no new mask. Windows and chunks with branches are
refused (patterns_meta), so no other cut falls inside a pair.

`plan(q_runs, k_runs, pattern)` lists the blocks of (local queries) x (keys held by another rank):
never a hidden block, never a row that sees none of the block's keys (so no kernel ever meets a
fully masked row), and every visible (query, key) cell exactly once over all ranks and ring steps.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from longdoc.parallel.layout import Branches, Packed, Run


@dataclass(frozen=True)
class Pattern:
    """Which keys a query sees; see the module docstring. Validated by longdoc.attention."""

    causal: bool = True
    window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    documents: Packed | None = None
    branches: Branches | None = None

    def normalized(self, seq_len: int) -> Pattern:
        """The same pattern with the parts that hide nothing at this length dropped (cheaper plans)."""
        window = self.window if self.window is not None and self.window < seq_len else None
        chunk = self.chunk_size if self.chunk_size is not None and self.chunk_size < seq_len else None
        # documents stay even when there is one: they also decide the layout (per-document zigzag)
        return Pattern(self.causal, window, chunk, self.softcap, self.documents, self.branches)

    @property
    def plain(self) -> bool:
        """No window, chunk, documents or branches: the plain causal / bidirectional plans apply."""
        return self.window is None and self.chunk_size is None and self.documents is None and self.branches is None


@dataclass(frozen=True)
class Block:
    """Local rows x local cols of one kernel call.

    causal: top-left aligned causal square. band (lo, hi): row r sees col c when lo <= c - r <= hi
    (None = unbounded), a mask the kernel builds only for this block.
    """

    rows: slice
    cols: slice
    causal: bool = False
    band: tuple[int | None, int | None] | None = None


def boundaries(seq_len: int, pattern: Pattern) -> tuple[int, ...]:
    """Sorted segment starts (documents, chunks, each pair's prompt / chosen / rejected), with seq_len at the end."""
    cuts = {0, seq_len}
    if pattern.documents is not None:
        cuts.update(pattern.documents.starts())
    if pattern.branches is not None:
        cuts.update(pattern.branches.cuts())
    if pattern.chunk_size is not None:
        starts = pattern.documents.starts() if pattern.documents is not None else (0, seq_len)
        for a, b in zip(starts, starts[1:]):
            cuts.update(range(a, b, pattern.chunk_size))
    return tuple(sorted(c for c in cuts if c <= seq_len))


def _pieces(runs_: tuple[Run, ...], cuts: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Runs split at segment boundaries: (global start, global end, local offset, segment index)."""
    out, offset = [], 0
    for start, length in runs_:
        pos, end = start, start + length
        while pos < end:
            seg = bisect.bisect_right(cuts, pos) - 1
            stop = min(end, cuts[seg + 1])
            out.append((pos, stop, offset + pos - start, seg))
            pos = stop
        offset += length
    return out


def tile_size(window: int | None) -> int | None:
    """Query rows per tile under a window: a quarter window (>= 64) computes ~1.25 w keys per row."""
    return None if window is None else max(64, window // 4)


def _lo(i: int, window: int | None) -> float:
    return i - window + 1 if window is not None else float("-inf")


def _hi(i: int, causal: bool) -> float:
    return i if causal else float("inf")


def _seeing_rows(qa: int, qb: int, ka: int, kb: int, q_off: int, pattern: Pattern) -> tuple[int, int, int] | None:
    """The queries of [qa, qb) that see at least one key of [ka, kb), as (qa, qb, q_off), or None. lo and hi are
    monotone, so they form a range, and no kernel ever gets a fully masked row (whose lse the CPU kernel
    reports as 0)."""
    top = max(qa, ka) if pattern.causal else qa
    bottom = min(qb, kb + pattern.window - 1) if pattern.window is not None else qb
    if top >= bottom:
        return None
    return top, bottom, q_off + top - qa


def _emit(out: list[Block], qa: int, qb: int, ka: int, kb: int, q_off: int, k_off: int, pattern: Pattern) -> None:
    """Blocks for global queries [qa, qb) x keys [ka, kb) of one segment; q_off/k_off: local index of qa/ka."""
    w, causal = pattern.window, pattern.causal
    seen = _seeing_rows(qa, qb, ka, kb, q_off, pattern)
    if seen is None:
        return
    qa, qb, q_off = seen
    ks, ke = max(ka, _lo(qa, w)), min(kb, _hi(qb - 1, causal) + 1)  # keys some row sees
    if ks >= ke:
        return
    fs, fe = max(ks, _lo(qb - 1, w)), min(ke, _hi(qa, causal) + 1)  # keys every row sees
    ks, ke = int(ks), int(ke)
    rows = slice(q_off, q_off + qb - qa)
    if causal and (ks, ke) == (qa, qb) and (w is None or w >= qb - qa):
        # the diagonal square in one causal call, not its first column + the square below: in half precision
        # every extra block covering a row is one more rounding of its partial result before the merge
        out.append(Block(rows, slice(k_off + ks - ka, k_off + ke - ka), causal=True))
        return

    def cols(a: int, b: int) -> slice:
        return slice(k_off + a - ka, k_off + b - ka)

    if fs <= ks and fe >= ke:
        out.append(Block(rows, cols(ks, ke)))
    elif fs >= fe:  # no key seen by every row: one band (or causal) block
        _edge(out, qa, qb, ks, ke, q_off, k_off + ks - ka, pattern)
    else:  # a full middle, and band (or causal) edges on either side
        fs, fe = int(fs), int(fe)
        out.append(Block(rows, cols(fs, fe)))
        for a, b in ((ks, fs), (fe, ke)):
            if a < b:
                _edge(out, qa, qb, a, b, q_off, k_off + a - ka, pattern)


def _edge(out: list[Block], qa: int, qb: int, ka: int, kb: int, q_off: int, k_off: int, pattern: Pattern) -> None:
    """One masked block for queries [qa, qb) x keys [ka, kb): a causal square, or a band whose two
    diagonals are the window's lower edge and the causal upper edge; rows that see none are dropped."""
    w, causal = pattern.window, pattern.causal
    seen = _seeing_rows(qa, qb, ka, kb, q_off, pattern)
    if seen is None:
        return
    qa, qb, q_off = seen
    rows, cols = slice(q_off, q_off + qb - qa), slice(k_off, k_off + kb - ka)
    if causal and (qa, qb) == (ka, kb) and (w is None or w >= qb - qa):
        out.append(Block(rows, cols, causal=True))
        return
    # row r (query qa + r) sees col c (key ka + c) when lo <= c - r <= hi
    lo = None if w is None or ka >= qb - w else (1 - w) - (ka - qa)
    hi = None if not causal or kb - 1 <= qa else qa - ka
    out.append(Block(rows, cols) if lo is None and hi is None else Block(rows, cols, band=(lo, hi)))


def _key_segments(cuts: tuple[int, ...], pattern: Pattern) -> dict[int, tuple[int, ...]]:
    """Query segment -> the key segments it sees where that is not just itself: a pair's chosen and rejected see
    their prompt and themselves (never each other). Needs no cut inside a prompt, chosen or rejected."""
    out: dict[int, tuple[int, ...]] = {}
    for p, c, r, _ in pattern.branches.spans if pattern.branches is not None else ():
        prompt, chosen, rejected = (bisect.bisect_right(cuts, x) - 1 for x in (p, c, r))
        out[chosen], out[rejected] = (prompt, chosen), (prompt, rejected)
    return out


@functools.lru_cache(maxsize=4096)
def plan(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], seq_len: int, pattern: Pattern) -> tuple[Block, ...]:
    """Blocks of (queries in q_runs) x (keys in k_runs), in local row / col indices; see the module doc."""
    cuts = boundaries(seq_len, pattern)
    by_segment: dict[int, list[tuple[int, int, int, int]]] = {}
    for piece in _pieces(k_runs, cuts):  # grouped, so packed rows of many documents plan in linear time
        by_segment.setdefault(piece[3], []).append(piece)
    tile = tile_size(pattern.window)
    seen = _key_segments(cuts, pattern)
    out: list[Block] = []
    for qa, qb, q_off, seg in _pieces(q_runs, cuts):
        keys = [piece for k_seg in seen.get(seg, (seg,)) for piece in by_segment.get(k_seg, ())]
        for ka, kb, k_off, _ in keys:
            if pattern.causal and ka > qb - 1:
                continue
            if pattern.window is not None and kb - 1 < qa - pattern.window + 1:
                continue
            step = tile or (qb - qa)
            for a in range(qa, qb, step):
                b = min(qb, a + step)
                _emit(out, a, b, ka, kb, q_off + a - qa, k_off, pattern)
    return tuple(out)


def steps_needed(all_runs: tuple[tuple[Run, ...], ...], seq_len: int, pattern: Pattern) -> int:
    """Ring steps until no rank needs another block: 1 + the last step any rank has work in.

    A pure function of metadata every rank holds, so all ranks stop together with no extra message.
    """
    size = len(all_runs)
    last = 0
    for rank in range(size):
        for step in range(1, size):
            if step > last and plan(all_runs[rank], all_runs[(rank - step) % size], seq_len, pattern):
                last = step
    return last + 1


# ---- band masks: built by the kernels for partial blocks only ----------------------------------

def band_hidden(rows: int, cols: int, band: tuple[int | None, int | None] | None, causal: bool = False,
                row_offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Bool (rows, cols), True where hidden: c - r outside band (rows counted from `row_offset`),
    or c > r when `causal`; None when nothing is hidden."""
    if band is None and not causal:
        return None
    d = torch.arange(cols, device=device).unsqueeze(0) - torch.arange(row_offset, row_offset + rows,
                                                                      device=device).unsqueeze(1)
    hidden = torch.zeros(rows, cols, dtype=torch.bool, device=device)
    lo, hi = band if band is not None else (None, None)
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    if lo is not None:
        hidden |= d < lo
    if hi is not None:
        hidden |= d > hi
    return hidden


def band_bias(rows: int, cols: int, band: tuple[int | None, int | None], dtype: torch.dtype,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Additive (rows, cols) mask of `dtype`: 0 where visible, -inf where hidden (what aten kernels take)."""
    hidden = band_hidden(rows, cols, band, device=device)
    return torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))
