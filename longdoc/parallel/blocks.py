"""Which blocks of the attention matrix a rank computes, and how partial results are merged.

Shared by ring.py and allgather.py. The plain plans (causal or bidirectional over one sequence) are
lists of (q_slice, kv_slice, causal) over local query rows and key columns; patterns (windows,
chunks, documents) are planned by masks.plan into `masks.Block`s. Either way blocks that the pattern
hides entirely are never listed, so no masked-out work is computed. `ring_blocks` / `gather_blocks`
give Blocks for any pattern, `ring_steps` how many ring steps any rank needs.
"""

from __future__ import annotations

import functools

import torch

from longdoc.parallel import layout as layouts
from longdoc.parallel import masks, selection
from longdoc.parallel.layout import Run
from longdoc.parallel.masks import Block, Pattern

Triple = tuple[slice, slice, bool]  # (rows, cols, causal) of the plain plans


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's softmax-normalized (out, lse) into the running (out, lse).

    Each partial output is normalized by its own log-sum-exp, so the exact merged result weights
    them by exp(lse_i - lse_new). This is done in the accumulator dtype (fp32 or fp64) and relative
    to the larger lse, so nothing overflows; a row no block has seen yet has lse = -inf and must not
    turn into exp(-inf - -inf) = NaN, hence the explicit guard: such rows stay exactly zero.
    out/block_out (..., len, head_dim), lse/block_lse (..., len); out and lse in the accumulator dtype.
    """
    block_lse = block_lse.to(lse.dtype)
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)
    total = w_old + w_new
    new_lse = m + torch.log(total)  # log(0) = -inf: still no key seen
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    new_out = (out * (w_old * inv).unsqueeze(-1)) + block_out.to(out.dtype) * (w_new * inv).unsqueeze(-1)
    return new_out, new_lse


def ring_plan(layout: str, rank: int, src: int, world_size: int, local_len: int, causal: bool) -> list[Triple]:
    """Blocks of (local queries) x (keys held by rank `src`) that `rank` computes in a ring step."""
    full = slice(0, local_len)
    if not causal:
        return [(full, full, False)]
    if src == rank:
        # Local chunks are in increasing global order in both layouts, so the local block is
        # exactly causal: zigzag's second chunk sees all of the first one.
        return [(full, full, True)]
    if layout == "contiguous":
        return [(full, full, False)] if src < rank else []
    half = local_len // 2
    if src < rank:
        # Both local query chunks see src's first chunk entirely and its second chunk not at all.
        return [(full, slice(0, half), False)]
    # Only the local second (late) chunk sees src's keys, and it sees both of src's chunks entirely.
    return [(slice(half, local_len), full, False)]


def prefix_plan(chunks: tuple[int, ...], chunk_len: int, seq_len: int, causal: bool) -> list[Triple]:
    """Blocks of (local queries) x (all keys in global order) for all-gather attention."""
    if not causal:
        return [(slice(0, len(chunks) * chunk_len), slice(0, seq_len), False)]
    plan: list[Triple] = []
    for i, g in enumerate(chunks):
        rows = slice(i * chunk_len, (i + 1) * chunk_len)
        if g > 0:
            plan.append((rows, slice(0, g * chunk_len), False))
        plan.append((rows, slice(g * chunk_len, (g + 1) * chunk_len), True))
    return plan


# ---- patterns: windows, chunks, documents (longdoc/parallel/masks.py does the maths) -----------

def all_runs(layout: str, size: int, seq_len: int, pattern: Pattern) -> tuple[tuple[Run, ...], ...]:
    """Every rank's pieces of the full sequence (a pure function of metadata all ranks share)."""
    return tuple(layouts.runs(layout, r, size, seq_len, pattern.documents) for r in range(size))


def _as_blocks(plan: list[tuple[slice, slice, bool]]) -> tuple[Block, ...]:
    return tuple(Block(rows, cols, causal) for rows, cols, causal in plan)


Runs = tuple[tuple[Run, ...], ...]  # every ring rank's pieces of the full sequence


@functools.lru_cache(maxsize=4096)
def ring_blocks(layout: str, rank: int, src: int, size: int, local_len: int, pattern: Pattern,
                runs: Runs | None = None) -> tuple[Block, ...]:
    """Blocks of (local queries) x (keys held by `src`) for any pattern; hidden blocks never listed.
    `runs` overrides the layout's pieces (the ring of a 2-D Ulysses x ring group holds other pieces)."""
    if pattern.plain and runs is None:
        return _as_blocks(ring_plan(layout, rank, src, size, local_len, pattern.causal))
    seq_len = local_len * size
    runs = all_runs(layout, size, seq_len, pattern) if runs is None else runs
    return masks.plan(runs[rank], runs[src], seq_len, pattern)


@functools.lru_cache(maxsize=1024)
def ring_steps(layout: str, size: int, local_len: int, pattern: Pattern, runs: Runs | None = None) -> int:
    """How many ring steps any rank needs (size, unless a window/chunk/documents hide the far blocks)."""
    if pattern.plain and runs is None:
        return size
    seq_len = local_len * size
    return masks.steps_needed(all_runs(layout, size, seq_len, pattern) if runs is None else runs, seq_len, pattern)


@functools.lru_cache(maxsize=1024)
def gather_blocks(layout: str, rank: int, size: int, local_len: int, pattern: Pattern) -> tuple[Block, ...]:
    """Blocks of (local queries) x (all keys, in global order) for all-gather attention."""
    seq_len = local_len * size
    if pattern.plain:
        chunks = layouts.chunk_ids(layout, rank, size)
        return _as_blocks(prefix_plan(chunks, local_len // len(chunks), seq_len, pattern.causal))
    runs = all_runs(layout, size, seq_len, pattern)
    return masks.plan(runs[rank], ((0, seq_len),), seq_len, pattern)


# ---- attention sinks: one learned logit per head in every row's softmax denominator -----------

def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the merged blocks -> with the sink in the denominator, folded once after all blocks.

    out *= exp(lse - logaddexp(lse, sink)); a row that saw no key stays zero (its lse becomes the sink's).
    out (batch, q_heads, len, head_dim) and lse (batch, q_heads, len) in the accumulator dtype.
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, sink.expand_as(lse))
    return out * torch.exp(lse - new_lse).unsqueeze(-1), new_lse


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks from the FINAL (out, lse): -sum over rows of p_sink * (dout . out)."""
    acc = lse.dtype
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


def kernel_call(kernel, band_kernel, blk: Block, softcap: float | None) -> tuple:
    """(kernel, extra kwargs) for one block: band blocks go to the band-capable kernel."""
    kern = band_kernel if blk.band is not None and band_kernel is not None else kernel
    if blk.band is None and softcap is None:
        return kern, {}  # the plain call every kernel accepts
    return kern, {"band": blk.band, "softcap": softcap}


# ---- one planned block, with or without selected keys ------------------------------------------

# A selection travels with its block plans as (selected (batch, local_len, n), global positions of the keys held,
# full sequence length); see longdoc/parallel/selection.py.
Selected = tuple[torch.Tensor, torch.Tensor, int]


def block_forward(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, blk: Block, kernel,
                  band_kernel, softcap: float | None, scale: float, sel: Selected | None = None) -> None:
    """Merge one planned block of q against kv (2, batch, kv_heads, len, dim) into (out, lse), in place."""
    if sel is None:
        kern, extra = kernel_call(kernel, band_kernel, blk, softcap)
        rows, cols = blk.rows, blk.cols
        o, l = kern.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], blk.causal, scale, **extra)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
        return
    selected, key_pos, seq_len = sel
    for rows, cols, hidden in selection.tiles(blk, selected, key_pos[blk.cols], seq_len):
        o, l = band_kernel.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], False, scale, softcap=softcap,
                                   mask=hidden)
        o, l = selection.fix_unseen(o, l, hidden)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)


def block_backward(dout, q, kv, out, lse, dq, dkv, blk: Block, kernel, band_kernel, softcap: float | None,
                   scale: float, sel: Selected | None = None) -> None:
    """Accumulate one planned block's (dq, dk, dv) into dq and dkv (2, batch, kv_heads, len, dim), in place,
    from the FINAL out and lse."""
    if sel is None:
        kern, extra = kernel_call(kernel, band_kernel, blk, softcap)
        pieces = [(blk.rows, blk.cols, kern, blk.causal, extra)]
    else:
        selected, key_pos, seq_len = sel
        pieces = [(rows, cols, band_kernel, False, {"softcap": softcap, "mask": hidden})
                  for rows, cols, hidden in selection.tiles(blk, selected, key_pos[blk.cols], seq_len)]
    for rows, cols, kern, causal, extra in pieces:
        dq_b, dk_b, dv_b = kern.backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                         out[:, :, rows], lse[:, :, rows], causal, scale, **extra)
        dq[:, :, rows] += dq_b
        dkv[0][:, :, cols] += dk_b
        dkv[1][:, :, cols] += dv_b
