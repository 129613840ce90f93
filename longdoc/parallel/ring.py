"""Ring attention: K/V blocks rotate around the context-parallel group.

Forward: at each of the N steps a rank computes its queries against the K/V block it holds while
the next block is already in flight (double buffering), and merges the partial (out, lse) in fp32.
Backward: K/V rotate again; dQ stays local, dK/dV accumulate in fp32 in a buffer that travels with
its K/V block and arrives back at the owner after the last step.
With the zigzag layout every rank does the same causal work at every step.
"""

from __future__ import annotations

import torch

from longdoc.parallel import blocks
from longdoc.parallel.comm import Ring
from longdoc.parallel.kernels import Kernel, _lse_dtype


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None, layout: str,
                 causal: bool, scale: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out like q, lse (batch, q_heads, local_len) in fp32/fp64)."""
    rank, size = (ring.rank, ring.size) if ring else (0, 1)
    acc = _lse_dtype(q.dtype)
    local_len = q.shape[2]
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # (2, batch, kv_heads, local_len, head_dim): one message per step
    spare = torch.empty_like(kv) if size > 1 else None
    for step in range(size):
        pending = ring.shift(kv, spare) if step + 1 < size else None
        src = (rank - step) % size
        for rows, cols, blk_causal in blocks.ring_plan(layout, rank, src, size, local_len, causal):
            o, l = kernel.forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], blk_causal, scale)
            out[:, :, rows], lse[:, :, rows] = blocks.merge(out[:, :, rows], lse[:, :, rows], o, l)
        if pending is not None:
            pending.wait()
            kv, spare = spare, kv
    return out.to(q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, ring: Ring | None, layout: str, causal: bool, scale: float,
                  kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rank, size = (ring.rank, ring.size) if ring else (0, 1)
    acc = _lse_dtype(q.dtype)
    local_len = q.shape[2]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv) if size > 1 else None
    dkv_pending, dkv_recv = None, None
    for step in range(size):
        kv_pending = ring.shift(kv, spare, tag=0) if step + 1 < size else None
        src = (rank - step) % size
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this step's dK/dV for src's block
        for rows, cols, blk_causal in blocks.ring_plan(layout, rank, src, size, local_len, causal):
            dq_b, dk_b, dv_b = kernel.backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                               kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows],
                                               blk_causal, scale)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
        if dkv_pending is not None:
            # What the previous ranks accumulated for src's block arrived during this step's compute.
            dkv_pending.wait()
            dkv += dkv_recv
        if size > 1:
            dkv_recv = torch.empty_like(dkv)
            dkv_pending = ring.shift(dkv, dkv_recv, tag=1)
        if kv_pending is not None:
            kv_pending.wait()
            kv, spare = spare, kv
    if dkv_pending is not None:
        dkv_pending.wait()
        dkv = dkv_recv  # after N hops the accumulator is back at the owner of the block
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, causal, scale, kernel):
        out, lse = ring_forward(q, k, v, ring, layout, causal, scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, layout, causal, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None, layout: str,
                   causal: bool, scale: float, kernel: Kernel) -> torch.Tensor:
    """Differentiable ring attention on validated local shards."""
    return RingAttention.apply(q, k, v, ring, layout, causal, scale, kernel)
