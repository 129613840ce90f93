"""Lightning attention (MiniMax-Text-01 / M1) as an affine state map, for state passing.

Per head, a constant decay exp(-s) (s = the head's slope rate) and a state KV (head_dim, head_dim):
    KV_t = exp(-s) KV_{t-1} + k_t^T v_t,        o_t = q_t KV_t.
Over a piece of L tokens entered with KV_in:
    KV_out = exp(-s L) KV_in + U,               o_t = o0_t + exp(-s (t + 1)) q_t KV_in     (t = 0 .. L-1)
where (o0, U) is the piece run from a zero state. The piece runs in blocks exactly as transformers'
MiniMaxLightningAttention does inside its forward (intra-block (Q K^T * decay) V plus the inter-block read of
the running KV), in the input dtype as the model does; the correction and the summaries are fp32
(or float64 for float64 inputs).
Torch only: this module knows no model.
"""

from __future__ import annotations

import torch

from longdoc.parallel.recurrent.protocol import acc_dtype


def run_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(o0, U) of one piece from a zero state. q, k, v: (batch, heads, len, head_dim); slope: (heads, 1, 1)."""
    bsz, heads, length, dim = q.shape
    # the decay factors in fp32 (or wider), then the input dtype: as the module's buffers are made
    slope = slope.to(acc_dtype(slope.dtype))
    kv = q.new_zeros(bsz, heads, dim, v.shape[-1])
    outs = []
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        n = end - start
        idx = torch.arange(1, n + 1, device=q.device, dtype=slope.dtype)[:, None]  # 1-based position in the block
        q_decay = torch.exp(-slope * idx).to(q.dtype)  # (heads, n, 1)
        k_decay = torch.exp(-slope * (n - idx)).to(q.dtype)
        rel = idx - idx.T  # i - j
        diag = torch.exp(torch.where(rel >= 0, -slope * rel, float("-inf")))[None].to(q.dtype)  # (1, heads, n, n)
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * diag, vb)
        outs.append(torch.matmul(qb * q_decay, kv) + intra)
        kv = kv * torch.exp(-slope * n).to(q.dtype) + torch.matmul((kb * k_decay).transpose(-1, -2), vb)
    return torch.cat(outs, dim=2), kv.to(acc_dtype(q.dtype))


def transition(slope: torch.Tensor, length: int) -> torch.Tensor:
    """T of a piece of `length` tokens: exp(-s L), (heads, 1, 1), fp32 or wider."""
    return torch.exp(-slope.to(acc_dtype(slope.dtype)) * length)


def advance(state: torch.Tensor | None, decay: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """KV after a piece with summary (T, U) entered with `state` (None: zero)."""
    return offset if state is None else decay * state + offset


def finish(out0: torch.Tensor, q: torch.Tensor, slope: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """The piece's output (batch, heads, len, head_dim), in q's dtype, when entered with `state`."""
    if state is None:
        return out0
    acc = acc_dtype(q.dtype)
    idx = torch.arange(1, q.shape[2] + 1, device=q.device, dtype=acc)[:, None]
    read = torch.matmul(q.to(acc) * torch.exp(-slope.to(acc) * idx), state.to(acc))
    return (out0.to(acc) + read).to(q.dtype)


class Lightning:
    """The state-passing contract (longdoc.parallel.recurrent.protocol.Recurrence) for one lightning layer.

    A piece is (q, k, v), (batch, heads, len, head_dim), time at dim 2; the state is (KV,) fp32; the summary
    is (T, U) with T (batch, heads, 1, 1).
    """

    def __init__(self, slope: torch.Tensor, block_size: int):
        self.slope, self.block_size = slope, block_size  # slope: (heads, 1, 1)

    def local(self, piece):
        q, k, v = piece
        out0, offset = run_piece(q, k, v, self.slope, self.block_size)
        decay = transition(self.slope, q.shape[2]).expand(q.shape[0], -1, -1, -1)
        return out0, (decay, offset)

    def advance(self, state, summary):
        return (advance(None if state is None else state[0], *summary),)

    def finish(self, piece, y0, state):
        return finish(y0, piece[0], self.slope, state[0])


__all__ = ["Lightning", "run_piece", "transition", "advance", "finish"]
