"""Closed forms for diagonal state-space recurrences (Mamba2's SSD, Mamba1's selective scan).

In both, the state entering a piece decays by a product of per-step factors exp(A * dt_t), so a piece entered
with S_in has the state S_t = exp(A * cumsum(dt)_t) * S_in + S0_t (S0: the zero-state run) and the output
y_t = y0_t + C_t . (exp(A * cumsum(dt)_t) * S_in): an additive correction, no re-run. The summary is
(log T, U) with log T = A * sum(dt) over the piece and U the zero-state final state; `advance` is
S_out = exp(log T) * S_in + U. The zero-state run is the caller's own scan function (for Hugging Face models
transformers' pure-torch path), called with the same arguments it would get in one process; the time-step
preprocessing below (bias, softplus, clamp) mirrors the kernel convention those functions share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longdoc.parallel.recurrent.protocol import State, Summary, acc, acc_dtype


def _advance(state: State | None, summary: Summary) -> State:
    log_t, u = summary
    if state is None:
        return (u,)
    (s,) = state
    t = torch.exp(log_t).reshape(*log_t.shape, *(1,) * (s.dim() - log_t.dim()))
    return (t * s + u,)


@dataclass(frozen=True)
class SSD:
    """Mamba2's SSD with `mamba_chunk_scan_combined` semantics: per-head scalar decay.

    Piece inputs: x (b, L, heads, head_dim), dt (b, L, heads), B and C (b, L, groups, state). State:
    (b, heads, head_dim, state). `scan` is called as scan(x, dt, A, B, C, chunk_size, D=, dt_bias=,
    dt_softplus=, dt_limit=, return_final_states=True) -> (y0, final_state)."""

    scan: Callable
    A: torch.Tensor  # (heads,)
    chunk_size: int
    D: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    def log_decay(self, dt: torch.Tensor) -> torch.Tensor:
        """A * dt per step, (b, L, heads) fp32, after the bias, softplus and clamp the scan applies."""
        if self.dt_bias is not None:
            dt = dt + self.dt_bias.to(dt.dtype)
        if self.dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=self.dt_limit[0], max=self.dt_limit[1])
        return acc(self.A) * acc(dt)

    def local(self, piece):
        x, dt, B, C = piece
        y0, s0 = self.scan(x, dt, self.A, B, C, self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                           dt_softplus=self.dt_softplus, dt_limit=self.dt_limit, return_final_states=True)
        return y0, (self.log_decay(dt).sum(dim=1), s0)  # log T (b, heads), U (b, heads, head_dim, state)

    advance = staticmethod(_advance)

    def finish(self, piece, y0, state):
        x, dt, B, C = piece
        (s,) = state
        heads, dtype = x.shape[2], torch.promote_types(acc_dtype(C.dtype), s.dtype)
        c = C.to(dtype).repeat_interleave(heads // C.shape[2], dim=2)  # (b, L, heads, state)
        decay = torch.exp(torch.cumsum(self.log_decay(dt), dim=1)).to(dtype)  # (b, L, heads)
        corr = torch.einsum("blhn,bhpn->blhp", c, s.to(dtype)) * decay[..., None]
        return y0 + corr.to(y0.dtype)


@dataclass(frozen=True)
class Selective:
    """Mamba1's selective scan with `selective_scan_fn` semantics: per-channel, per-state decay.

    Piece inputs: x and dt (b, channels, L), B and C (b, state, L). State: (b, channels, state). `scan` is
    called as scan(x, dt, A, B, C, D=, z=None, delta_bias=, delta_softplus=, return_last_state=True, **extra)
    -> (y0, last_state); the output gate z is the caller's to apply after the correction.

    Outputs are fp32 (float64 for float64 inputs); the caller rounds once to `out_dtype`. The piece runs on fp32
    inputs, as delta.run_piece does: a bf16 scan would round its zero-state output y0 (transformers' torch scan
    rounds the state and C . state to the input dtype), and the correction added to it would round a second time,
    where one process rounds C . state once. In fp32 the corrected output is rounded once, at the end."""

    scan: Callable
    A: torch.Tensor  # (channels, state)
    D: torch.Tensor | None = None
    delta_bias: torch.Tensor | None = None
    delta_softplus: bool = False
    extra: tuple[tuple[str, object], ...] = ()  # more keyword arguments for `scan`

    def out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the scan returns for input `x` (C . state in x's dtype, plus the D skip connection)."""
        return x.dtype if self.D is None else torch.promote_types(x.dtype, self.D.dtype)

    def step(self, dt: torch.Tensor) -> torch.Tensor:
        """dt per step after the bias and softplus the scan applies, (b, channels, L)."""
        if self.delta_bias is not None:
            dt = dt + self.delta_bias.to(dt.dtype)[..., None]
        if self.delta_softplus:
            dt = F.softplus(dt)
        return dt

    def local(self, piece):
        x, dt, B, C = (acc(t) for t in piece)
        y0, s0 = self.scan(x, dt, self.A, B, C, D=self.D, z=None, delta_bias=self.delta_bias,
                           delta_softplus=self.delta_softplus, return_last_state=True, **dict(self.extra))
        log_t = acc(self.A)[None] * self.step(dt).sum(dim=-1)[..., None]  # (b, channels, state)
        return acc(y0), (log_t, s0)

    advance = staticmethod(_advance)

    def finish(self, piece, y0, state):
        x, dt, B, C = (acc(t) for t in piece)
        (s,) = state
        dtype = torch.promote_types(torch.promote_types(C.dtype, s.dtype), y0.dtype)
        cum = torch.cumsum(self.step(dt).to(dtype), dim=-1)  # (b, channels, L)
        decay = torch.exp(self.A.to(dtype)[None, :, None, :] * cum[..., None])  # (b, channels, L, state)
        corr = torch.einsum("bdln,bdn,bnl->bdl", decay, s.to(dtype), C.to(dtype))
        return y0.to(dtype) + corr
