"""Which blocks of the attention matrix a rank computes, and how partial results are merged.

Shared by ring.py and allgather.py. A plan is a list of (q_slice, kv_slice, causal) over local
query rows and key columns; blocks that a causal mask hides entirely are never listed, so no masked
work is computed.
"""

from __future__ import annotations

import torch

Block = tuple[slice, slice, bool]


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


def ring_plan(layout: str, rank: int, src: int, world_size: int, local_len: int, causal: bool) -> list[Block]:
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


def prefix_plan(chunks: tuple[int, ...], chunk_len: int, seq_len: int, causal: bool) -> list[Block]:
    """Blocks of (local queries) x (all keys in global order) for all-gather attention."""
    if not causal:
        return [(slice(0, len(chunks) * chunk_len), slice(0, seq_len), False)]
    plan: list[Block] = []
    for i, g in enumerate(chunks):
        rows = slice(i * chunk_len, (i + 1) * chunk_len)
        if g > 0:
            plan.append((rows, slice(0, g * chunk_len), False))
        plan.append((rows, slice(g * chunk_len, (g + 1) * chunk_len), True))
    return plan
