"""All-gather-KV attention (Llama-3 style): gather the full K/V, attend with local queries.

Forward: all-gather the compact K/V (kv_heads, so GQA keeps it small), reorder to global order,
attend the local queries to the keys their pattern shows them (causal prefix, window, chunk,
document). Backward: gather K/V again (only the local shard is kept for backward), accumulate dK/dV
for the whole sequence in fp32, and reduce-scatter them back to their owners. Simpler than the ring
and one collective per pass, at the cost of holding the full K/V for one layer at a time.
Attention sinks are folded once into the result (blocks.fold_sinks). Selected keys (sparse indexed attention)
mask the blocks tile by tile (longdoc/parallel/selection.py).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from longdoc.parallel import blocks, comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.kernels import Kernel, lse_dtype
from longdoc.parallel.masks import Block, Pattern


def _rank_size(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _pieces(group, layout: str, seq_len: int, pattern: Pattern) -> list[tuple[layouts.Run, ...]]:
    return list(blocks.all_runs(layout, _rank_size(group)[1], seq_len, pattern))


def _gather_kv(kv: torch.Tensor, group, timeout, layout: str, pattern: Pattern, guard=None) -> torch.Tensor:
    if group is None:
        return kv
    seq_len = kv.shape[3] * dist.get_world_size(group)
    parts = comm.all_gather(kv, group, timeout, guard, "all_gather kv")
    return layouts.unshard_runs(parts, 3, _pieces(group, layout, seq_len, pattern))


def _plan(q_len: int, group, layout: str, pattern: Pattern) -> tuple[Block, ...]:
    rank, size = _rank_size(group)
    return blocks.gather_blocks(layout, rank, size, q_len, pattern)


def _selection(selected: torch.Tensor | None, kv: torch.Tensor) -> blocks.Selected | None:
    if selected is None:
        return None
    seq_len = kv.shape[3]  # gathered, in global order
    return selected, torch.arange(seq_len, device=selected.device), seq_len


def allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, timeout, layout: str,
                      causal: bool, scale: float, kernel: Kernel, pattern: Pattern | None = None,
                      band_kernel: Kernel | None = None, guard=None,
                      selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout, pattern, guard)  # (2, batch, kv_heads, seq, head_dim)
    sel = _selection(selected, kv)
    for blk in _plan(q.shape[2], group, layout, pattern):
        blocks.block_forward(q, kv, out, lse, blk, kernel, band_kernel, pattern.softcap, scale, sel)
    return out.to(q.dtype), lse


def allgather_backward(dout, q, k, v, out, lse, group, timeout, layout: str, causal: bool, scale: float,
                       kernel: Kernel, pattern: Pattern | None = None, band_kernel: Kernel | None = None,
                       guard=None, selected: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout, pattern, guard)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    sel = _selection(selected, kv)
    for blk in _plan(q.shape[2], group, layout, pattern):
        blocks.block_backward(dout, q, kv, out, lse, dq, dkv, blk, kernel, band_kernel, pattern.softcap, scale, sel)
    if group is not None:
        pieces = _pieces(group, layout, kv.shape[3], pattern)
        parts = [layouts.shard_runs(dkv, 3, p) for p in pieces]
        dkv = comm.reduce_scatter(parts, group, timeout, guard, "reduce_scatter dkv")
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, timeout, layout, pattern, scale, kernel, band_kernel, guard, selected):
        out, lse = allgather_forward(q, k, v, group, timeout, layout, pattern.causal, scale, kernel, pattern,
                                     band_kernel, guard, selected)
        if sinks is not None:
            out, lse = blocks.fold_sinks(out.to(lse.dtype), lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, selected)
        ctx.args = (group, timeout, layout, pattern.causal, scale, kernel, pattern, band_kernel, guard)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, selected = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, *ctx.args, selected=selected)
        dsinks = blocks.sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, *[None] * 9  # group ... guard, selected


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                        timeout: datetime.timedelta | None, layout: str, causal: bool, scale: float,
                        kernel: Kernel, *, pattern: Pattern | None = None, sinks: torch.Tensor | None = None,
                        band_kernel: Kernel | None = None, guard=None,
                        selected: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable all-gather-KV attention on validated local shards (`pattern` overrides `causal`)."""
    pattern = pattern or Pattern(causal)
    return AllGatherAttention.apply(q, k, v, sinks, group, timeout, layout, pattern, scale, kernel, band_kernel,
                                    guard, selected)
