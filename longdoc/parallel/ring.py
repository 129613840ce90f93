"""Ring attention: K/V blocks rotate around the context-parallel group.

Forward: at each step a rank computes its queries against the K/V block it holds while the next
block is already in flight (double buffering), and merges the partial (out, lse) in fp32.
Backward: K/V rotate again; dQ stays local, dK/dV accumulate in fp32 in a buffer that travels with
its K/V block and goes back to the owner after the last step.
With the zigzag layout (per document for packed rows) every rank does the same causal work. Under a
window, chunks or documents the blocks no rank needs are never computed, and the ring stops after
`blocks.ring_steps` steps (the same number on every rank, from metadata: no extra message).
Attention sinks are folded once into the merged result (blocks.fold_sinks), never once per block.
Selected keys (sparse indexed attention) mask the blocks tile by tile (longdoc/parallel/selection.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longdoc.parallel import blocks, selection
from longdoc.parallel.blocks import Runs
from longdoc.parallel.comm import Pending, Ring
from longdoc.parallel.kernels import Kernel, lse_dtype
from longdoc.parallel.masks import Pattern


def _selection(selected: torch.Tensor | None, layout: str, src: int, size: int, local_len: int,
               pattern: Pattern) -> blocks.Selected | None:
    if selected is None:
        return None
    seq_len = local_len * size
    return selected, selection.key_positions(layout, src, size, seq_len, pattern, selected.device), seq_len


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None, layout: str,
                 causal: bool, scale: float, kernel: Kernel, pattern: Pattern | None = None,
                 band_kernel: Kernel | None = None, runs: Runs | None = None,
                 selected: torch.Tensor | None = None, merged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out like q, lse (batch, q_heads, local_len) in fp32/fp64), before any sinks.
    merged: out in the accumulator dtype, unrounded (for a caller that folds sinks in first, then rounds once).
    `runs`: every ring rank's pieces of the sequence when they are not the layout's (the ring of usp).
    selected: (batch, local_len, n) global key positions per query (longdoc/parallel/selection.py), or None
    (never with `runs`: selected-key attention runs on the ring and all-gather strategies only)."""
    rank, size = (ring.rank, ring.size) if ring else (0, 1)
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    local_len = q.shape[2]
    steps = blocks.ring_steps(layout, size, local_len, pattern, runs)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # (2, batch, kv_heads, local_len, head_dim): one message per step
    spare = torch.empty_like(kv) if steps > 1 else None
    for step in range(steps):
        pending = ring.shift(kv, spare) if step + 1 < steps else None
        src = (rank - step) % size
        sel = _selection(selected, layout, src, size, local_len, pattern)
        for blk in blocks.ring_blocks(layout, rank, src, size, local_len, pattern, runs):
            blocks.block_forward(q, kv, out, lse, blk, kernel, band_kernel, pattern.softcap, scale, sel)
        if pending is not None:
            pending.wait()
            kv, spare = spare, kv
    return (out if merged else out.to(q.dtype)), lse


def _send_home(ring: Ring, dkv: torch.Tensor, steps: int) -> tuple[Pending, torch.Tensor]:
    """Send the dK/dV accumulated for the block held at the last step to its owner (rank - steps + 1),
    and receive this rank's own from rank + steps - 1. With steps == size that is the ring neighbour."""
    recv = torch.empty_like(dkv)
    if ring.guard is not None:
        ring.guard.check("ring send-home tag=2", dkv.numel() * dkv.element_size())
    to = dist.get_global_rank(ring.group, (ring.rank - steps + 1) % ring.size)
    frm = dist.get_global_rank(ring.group, (ring.rank + steps - 1) % ring.size)
    ops = [dist.P2POp(dist.isend, dkv, to, ring.group, 2), dist.P2POp(dist.irecv, recv, frm, ring.group, 2)]
    return Pending(dist.batch_isend_irecv(ops), ring.timeout, "ring send/recv", [to, frm]), recv


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, ring: Ring | None, layout: str, causal: bool, scale: float,
                  kernel: Kernel, pattern: Pattern | None = None, band_kernel: Kernel | None = None,
                  runs: Runs | None = None, selected: torch.Tensor | None = None,
                  dkv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the FINAL out and lse (sinks folded in, if any). dkv_dtype: dk, dv in that dtype
    (default k's); the fp32 accumulator for a caller that sums them further (Ulysses' replicated heads)."""
    rank, size = (ring.rank, ring.size) if ring else (0, 1)
    pattern = pattern or Pattern(causal)
    acc = lse_dtype(q.dtype)
    local_len = q.shape[2]
    steps = blocks.ring_steps(layout, size, local_len, pattern, runs)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    spare = torch.empty_like(kv) if steps > 1 else None
    dkv_pending, dkv_recv = None, None
    for step in range(steps):
        kv_pending = ring.shift(kv, spare, tag=0) if step + 1 < steps else None
        src = (rank - step) % size
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this step's dK/dV for src's block
        sel = _selection(selected, layout, src, size, local_len, pattern)
        for blk in blocks.ring_blocks(layout, rank, src, size, local_len, pattern, runs):
            blocks.block_backward(dout, q, kv, out, lse, dq, dkv, blk, kernel, band_kernel, pattern.softcap, scale,
                                  sel)
        if dkv_pending is not None:
            # What the previous ranks accumulated for src's block arrived during this step's compute.
            dkv_pending.wait()
            dkv += dkv_recv
        if steps > 1 and (step + 1 < steps or steps == size):  # on to the next rank (the owner, at the end)
            dkv_recv = torch.empty_like(dkv)
            dkv_pending = ring.shift(dkv, dkv_recv, tag=1)
        elif steps > 1:
            dkv_pending, dkv_recv = _send_home(ring, dkv, steps)
        if kv_pending is not None:
            kv_pending.wait()
            kv, spare = spare, kv
    if dkv_pending is not None:
        dkv_pending.wait()
        dkv = dkv_recv  # the accumulator of this rank's own block, back from the last rank that used it
    return dq.to(q.dtype), dkv[0].to(dkv_dtype or k.dtype), dkv[1].to(dkv_dtype or v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, ring, layout, pattern, scale, kernel, band_kernel, selected):
        out, lse = ring_forward(q, k, v, ring, layout, pattern.causal, scale, kernel, pattern, band_kernel,
                                selected=selected, merged=sinks is not None)
        if sinks is not None:
            out, lse = blocks.fold_sinks(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, selected)
        ctx.args = (ring, layout, pattern.causal, scale, kernel, pattern, band_kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, selected = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args, selected=selected)
        dsinks = blocks.sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None, layout: str,
                   causal: bool, scale: float, kernel: Kernel, *, pattern: Pattern | None = None,
                   sinks: torch.Tensor | None = None, band_kernel: Kernel | None = None,
                   selected: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable ring attention on validated local shards (`pattern` overrides `causal`)."""
    pattern = pattern or Pattern(causal)
    return RingAttention.apply(q, k, v, sinks, ring, layout, pattern, scale, kernel, band_kernel, selected)
