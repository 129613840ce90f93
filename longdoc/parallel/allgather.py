"""All-gather-KV attention (Llama-3 style): gather the full K/V, attend with local queries.

Forward: all-gather the compact K/V (kv_heads, so GQA keeps it small), reorder to global order,
attend the local queries to the keys their pattern shows them (causal prefix, window, chunk,
document). Backward: gather K/V again (only the local shard is kept for backward), accumulate dK/dV
for the whole sequence in fp32, and reduce-scatter them back to their owners. Simpler than the ring
and one collective per pass, at the cost of holding the full K/V for one layer at a time.
Attention sinks are folded once into the result (blocks.fold_sinks).
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


def _gather_kv(kv: torch.Tensor, group, timeout, layout: str, pattern: Pattern) -> torch.Tensor:
    if group is None:
        return kv
    seq_len = kv.shape[3] * dist.get_world_size(group)
    return layouts.unshard_runs(comm.all_gather(kv, group, timeout), 3, _pieces(group, layout, seq_len, pattern))


def _plan(q_len: int, group, layout: str, pattern: Pattern) -> tuple[Block, ...]:
    rank, size = _rank_size(group)
    return blocks.gather_blocks(layout, rank, size, q_len, pattern)


def allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, timeout, layout: str,
                      causal: bool, scale: float, kernel: Kernel, pattern: Pattern | None = None,
                      band_kernel: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout, pattern)  # (2, batch, kv_heads, seq, head_dim)
    for blk in _plan(q.shape[2], group, layout, pattern):
        kern, extra = blocks.kernel_call(kernel, band_kernel, blk, pattern.softcap)
        rows, cols = blk.rows, blk.cols
        o, l = kern.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], blk.causal, scale, **extra)
        out[:, :, rows], lse[:, :, rows] = blocks.merge(out[:, :, rows], lse[:, :, rows], o, l)
    return out.to(q.dtype), lse


def allgather_backward(dout, q, k, v, out, lse, group, timeout, layout: str, causal: bool, scale: float,
                       kernel: Kernel, pattern: Pattern | None = None,
                       band_kernel: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout, pattern)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    for blk in _plan(q.shape[2], group, layout, pattern):
        kern, extra = blocks.kernel_call(kernel, band_kernel, blk, pattern.softcap)
        rows, cols = blk.rows, blk.cols
        dq_b, dk_b, dv_b = kern.backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                         out[:, :, rows], lse[:, :, rows], blk.causal, scale, **extra)
        dq[:, :, rows] += dq_b
        dkv[0][:, :, cols] += dk_b
        dkv[1][:, :, cols] += dv_b
    if group is not None:
        pieces = _pieces(group, layout, kv.shape[3], pattern)
        parts = [layouts.shard_runs(dkv, 3, p) for p in pieces]
        dkv = comm.reduce_scatter(parts, group, timeout)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, timeout, layout, pattern, scale, kernel, band_kernel):
        out, lse = allgather_forward(q, k, v, group, timeout, layout, pattern.causal, scale, kernel, pattern,
                                     band_kernel)
        if sinks is not None:
            out, lse = blocks.fold_sinks(out.to(lse.dtype), lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, timeout, layout, pattern.causal, scale, kernel, pattern, band_kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = blocks.sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                        timeout: datetime.timedelta | None, layout: str, causal: bool, scale: float,
                        kernel: Kernel, *, pattern: Pattern | None = None, sinks: torch.Tensor | None = None,
                        band_kernel: Kernel | None = None) -> torch.Tensor:
    """Differentiable all-gather-KV attention on validated local shards (`pattern` overrides `causal`)."""
    pattern = pattern or Pattern(causal)
    return AllGatherAttention.apply(q, k, v, sinks, group, timeout, layout, pattern, scale, kernel, band_kernel)
