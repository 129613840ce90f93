"""Selected-key attention: each query sees only the keys listed for it, by GLOBAL position.

Sparse indexed attention (DeepSeek's DSA and its relatives) picks, per query, a set of keys with a learned
indexer; attention then runs over those keys only. To the CP core that is one more pattern, like documents or
windows, except that it is data rather than metadata: `selected` (batch, local_len, n) holds, for every local
query, n global key positions (entries < 0 are unused slots). Query i sees key j when j is in selected[i] AND
the rest of the pattern shows it (causal, documents, ...).

Ring and all-gather attention compute the blocks their plans list as before; inside a block this module cuts
the rows into tiles whose (batch, rows, cols) mask stays below `MASK_ELEMENTS`, builds each tile's mask from
the selection (a column lookup of the block's key positions, never a (local x all keys) matrix), and skips
tiles in which no query selected any of the block's keys. A kernel that meets a row whose keys are all hidden
returns garbage for it; `fix_unseen` makes such rows (0, -inf) before the log-sum-exp merge, and the backward,
which works from the final lse, gets exp(-inf) = 0 for them. The selection carries no gradient (a top-k).
"""

from __future__ import annotations

import torch

from longdoc.parallel import layout as layouts
from longdoc.parallel.masks import Block, Pattern, band_hidden

MASK_ELEMENTS = 1 << 23  # bool cells per tile mask (8 MB; the additive mask a kernel builds is 2-4x that)


def key_positions(layout: str, rank: int, size: int, seq_len: int, pattern: Pattern,
                  device: torch.device) -> torch.Tensor:
    """Global positions of the keys `rank` holds, in its local order."""
    runs = layouts.runs(layout, rank, size, seq_len, pattern.documents)
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in runs])


def visible(selected: torch.Tensor, cols_pos: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(batch, rows, cols) bool: key at global position cols_pos[c] is in selected[b, r]."""
    n_cols = cols_pos.numel()
    col_of = torch.full((seq_len + 1,), n_cols, dtype=torch.long, device=selected.device)
    col_of[cols_pos] = torch.arange(n_cols, device=selected.device)
    sel = selected.long()
    sel = torch.where((sel >= 0) & (sel < seq_len), sel, seq_len)  # unused / out-of-range slots -> the dump column
    seen = torch.zeros((*sel.shape[:2], n_cols + 1), dtype=torch.bool, device=selected.device)
    seen.scatter_(2, col_of[sel], True)
    return seen[..., :n_cols]


def _structural_cols(blk: Block, r0: int, r1: int, n_cols: int) -> tuple[int, int]:
    """The block columns rows [r0, r1) (block-relative) can see at all under the block's causal square / band."""
    lo, hi = 0, n_cols
    if blk.causal:
        hi = min(hi, r1)  # top-left aligned: row r sees c <= r
    if blk.band is not None:
        b_lo, b_hi = blk.band
        if b_lo is not None:
            lo = max(lo, r0 + b_lo)
        if b_hi is not None:
            hi = min(hi, r1 - 1 + b_hi + 1)
    return lo, max(lo, hi)


def tiles(blk: Block, selected: torch.Tensor, cols_pos: torch.Tensor,
          seq_len: int) -> list[tuple[slice, slice, torch.Tensor]]:
    """(rows, cols, hidden) tiles of one planned block, in the block's local row / col indices: hidden (batch,
    rows, cols) is True where a query does not see a key (not selected, or outside the block's causal square /
    band). Each tile's columns are cut to the span its queries see any key of, and tiles where nothing is seen
    are left out. cols_pos: global positions of the block's key columns."""
    n_rows = blk.rows.stop - blk.rows.start
    n_cols = cols_pos.numel()
    step = max(1, MASK_ELEMENTS // max(1, selected.shape[0] * n_cols))
    out = []
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        c0, c1 = _structural_cols(blk, r0, r1, n_cols)
        if c0 >= c1:
            continue
        rows = slice(blk.rows.start + r0, blk.rows.start + r1)
        hidden = ~visible(selected[:, rows], cols_pos[c0:c1], seq_len)
        band = None
        if blk.band is not None:  # the band in this sub-block's coordinates: c - r shifts by c0 - r0
            band = tuple(None if b is None else b - (c0 - r0) for b in blk.band)
        structural = band_hidden(r1 - r0, c1 - c0, band, False, 0, device=hidden.device)
        if blk.causal:  # row r (block row r0 + r) sees block column c0 + c when c0 + c <= r0 + r
            causal = band_hidden(r1 - r0, c1 - c0, (None, r0 - c0), False, 0, device=hidden.device)
            structural = causal if structural is None else structural | causal
        if structural is not None:
            hidden |= structural
        span = torch.nonzero(~hidden.all(dim=1).all(dim=0)).flatten()  # columns some query sees
        if span.numel() == 0:
            continue
        a, b = int(span[0]), int(span[-1]) + 1
        cols = slice(blk.cols.start + c0 + a, blk.cols.start + c0 + b)
        out.append((rows, cols, hidden[..., a:b]))
    return out


def fix_unseen(out: torch.Tensor, lse: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a tile that see none of its keys: out 0 and lse -inf (kernels report garbage for them).
    out (batch, heads, rows, dim), lse (batch, heads, rows), hidden (batch, rows, cols)."""
    seen = ~hidden.all(dim=-1)  # (batch, rows)
    if bool(seen.all()):
        return out, lse
    lse = torch.where(seen[:, None], lse, torch.full_like(lse, float("-inf")))
    return torch.where(seen[:, None, :, None], out, torch.zeros_like(out)), lse
