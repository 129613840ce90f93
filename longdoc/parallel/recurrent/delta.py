"""Delta-rule linear attention (Gated DeltaNet, Kimi Delta Attention) as an affine state map, for state passing.

Per head the state S (k_dim, v_dim) follows  S_t = A_t S_{t-1} + beta_t k_t v_t^T  with a DENSE transition
A_t = (I - beta_t k_t k_t^T) * exp(g_t) (a scalar decay per head for GDN, a per-channel diagonal one for KDA),
and the output reads o_t = S_t^T q_t. Over a piece of tokens, then,

    S_out = T S_in + U,        o_t = o0_t + r_t S_in        with  r_t = (A_t ... A_1)^T q_t.

All four come from ONE run of the model's own chunked kernel on values augmented by k_dim zero columns and the
initial state [0 | I]: the zero columns carry the identity through the transitions, so the extra output
columns are r_t and the extra state columns are T, and the first columns are the zero-state run (o0, U).
No closed form to re-derive per kernel variant, and the kernel's own chunking does the work; the price is
v_dim + k_dim value columns instead of v_dim. With the true entering state S_in (from the other pieces'
summaries) the output is o0 + r S_in: no second run.

`kernel` is the pure-torch chunk function of the model (transformers' `torch_chunk_gated_delta_rule` or
`chunk_kimi_delta_attention`, signature (q, k, v, g, beta, *, initial_state, output_final_state,
use_qk_l2norm_in_kernel)); pass the torch path itself, never a fused kernel (longdoc.hf.recurrent.torch_path
finds it behind transformers' kernel entry points).
Torch only: this module knows no model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from longdoc.parallel.recurrent.protocol import acc_dtype


class DeltaPiece(NamedTuple):
    """One piece of tokens run from the augmented state: what the entering state is still needed for."""

    # all fp32, or float64 for float64 inputs
    out0: torch.Tensor  # (batch, len, v_heads, v_dim): the output from a zero entering state
    reads: torch.Tensor  # (batch, len, v_heads, k_dim): r_t, how o_t reads the entering state
    transition: torch.Tensor  # (batch, v_heads, k_dim, k_dim): T
    offset: torch.Tensor  # (batch, v_heads, k_dim, v_dim): U, the final state from a zero entering state


def run_piece(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, **kernel_kwargs) -> DeltaPiece:
    """One piece from the augmented state [0 | I] (see the module docstring).

    q, k: (batch, len, k_heads, k_dim); v: (batch, len, v_heads, v_dim); g, beta as `kernel` takes them.
    """
    bsz, _, v_heads, v_dim = v.shape
    k_dim = k.shape[-1]
    # fp32 (or float64) in, so the kernel (which computes in fp32 anyway) hands back fp32 outputs: the correction
    # o0 + r S is then added before the one rounding to the model's dtype, as the single-process kernel rounds once.
    acc = acc_dtype(v.dtype)
    q, k = q.to(acc), k.to(acc)
    v_aug = torch.cat([v.to(acc), v.new_zeros(*v.shape[:-1], k_dim, dtype=acc)], dim=-1)
    eye = torch.eye(k_dim, dtype=acc, device=v.device)
    init = torch.cat([v.new_zeros(bsz, v_heads, k_dim, v_dim, dtype=acc), eye.expand(bsz, v_heads, k_dim, k_dim)],
                     dim=-1)
    kernel_kwargs = {**kernel_kwargs, "initial_state": init, "output_final_state": True}
    out, state = kernel(q, k, v_aug, g, beta, **kernel_kwargs)
    out0, reads = out.to(acc).split([v_dim, k_dim], dim=-1)
    offset, transition = state.to(acc).split([v_dim, k_dim], dim=-1)
    return DeltaPiece(out0, reads, transition, offset)


def advance(state: torch.Tensor | None, transition: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The state after a piece with summary (T, U) entered with `state` (None: zero): T S + U."""
    return offset if state is None else transition @ state + offset


def finish(piece: DeltaPiece, state: torch.Tensor | None) -> torch.Tensor:
    """The piece's output (batch, len, v_heads, v_dim) fp32 when it is entered with `state` (None: zero)."""
    if state is None:
        return piece.out0
    return piece.out0 + torch.einsum("blhk,bhkv->blhv", piece.reads, state.to(piece.reads.dtype))


def scan(kernel: Callable, q, k, v, g, beta, initial_state: torch.Tensor | None = None,
         **kernel_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32, final state) of one piece entered with `initial_state`: run_piece + finish + advance."""
    piece = run_piece(kernel, q, k, v, g, beta, **kernel_kwargs)
    return finish(piece, initial_state), advance(initial_state, piece.transition, piece.offset)


class DeltaRule:
    """The state-passing contract (longdoc.parallel.recurrent.protocol.Recurrence) for a delta-rule layer.

    A piece is (q, k, v, g, beta), time at dim 1; the state is (S,), S (batch, v_heads, k_dim, v_dim) fp32; the
    summary is (T, U). `local` also returns the piece's reads r_t as its carry, so `finish` is o0 + r S_in with
    no second kernel run. Outputs are fp32 (the caller rounds once to the model's dtype).
    """

    def __init__(self, kernel: Callable, **kernel_kwargs):
        self.kernel, self.kernel_kwargs = kernel, kernel_kwargs

    def local(self, piece):
        p = run_piece(self.kernel, *piece, **self.kernel_kwargs)
        return p.out0, (p.transition, p.offset), p.reads

    def advance(self, state, summary):
        transition, offset = summary
        return (advance(None if state is None else state[0], transition, offset),)

    def finish(self, piece, y0, state, carry=None):
        reads = carry if carry is not None else run_piece(self.kernel, *piece, **self.kernel_kwargs).reads
        return y0 + torch.einsum("blhk,bhkv->blhv", reads, state[0].to(reads.dtype))


__all__ = ["DeltaPiece", "DeltaRule", "run_piece", "advance", "finish", "scan"]
