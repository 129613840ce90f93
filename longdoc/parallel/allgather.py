"""All-gather-KV attention (Llama-3 style): gather the full K/V, attend with local queries.

Forward: all-gather the compact K/V (kv_heads, so GQA keeps it small), reorder to global order,
attend the local query chunks to their causal prefix. Backward: gather K/V again (only the local
shard is kept for backward), accumulate dK/dV for the whole sequence in fp32, and reduce-scatter them
back to their owners. Simpler than the ring and one collective per pass, at the cost of holding the
full K/V for one layer at a time.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from longdoc.parallel import blocks, comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.kernels import Kernel, _lse_dtype


def _gather_kv(kv: torch.Tensor, group, timeout, layout: str) -> torch.Tensor:
    if group is None:
        return kv
    return layouts.unshard(comm.all_gather(kv, group, timeout), dim=3, layout=layout)


def _plan(q_len: int, group, layout: str, causal: bool) -> list[blocks.Block]:
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    chunks = layouts.chunk_ids(layout, rank, size)
    chunk_len = q_len // len(chunks)
    return blocks.prefix_plan(chunks, chunk_len, chunk_len * layouts.num_chunks(layout, size), causal)


def allgather_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, timeout, layout: str,
                      causal: bool, scale: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _lse_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout)  # (2, batch, kv_heads, seq_len, head_dim)
    for rows, cols, blk_causal in _plan(q.shape[2], group, layout, causal):
        o, l = kernel.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], blk_causal, scale)
        out[:, :, rows], lse[:, :, rows] = blocks.merge(out[:, :, rows], lse[:, :, rows], o, l)
    return out.to(q.dtype), lse


def allgather_backward(dout, q, k, v, out, lse, group, timeout, layout: str, causal: bool, scale: float,
                       kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _lse_dtype(q.dtype)
    kv = _gather_kv(torch.stack([k, v]), group, timeout, layout)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    for rows, cols, blk_causal in _plan(q.shape[2], group, layout, causal):
        dq_b, dk_b, dv_b = kernel.backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                           out[:, :, rows], lse[:, :, rows], blk_causal, scale)
        dq[:, :, rows] += dq_b
        dkv[0][:, :, cols] += dk_b
        dkv[1][:, :, cols] += dv_b
    if group is not None:
        size = dist.get_world_size(group)
        parts = [layouts.shard(dkv, 3, r, size, layout) for r in range(size)]
        dkv = comm.reduce_scatter(parts, group, timeout)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, timeout, layout, causal, scale, kernel):
        out, lse = allgather_forward(q, k, v, group, timeout, layout, causal, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, timeout, layout, causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = allgather_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                        timeout: datetime.timedelta | None, layout: str, causal: bool, scale: float,
                        kernel: Kernel) -> torch.Tensor:
    """Differentiable all-gather-KV attention on validated local shards."""
    return AllGatherAttention.apply(q, k, v, group, timeout, layout, causal, scale, kernel)
