"""Sequential float64 references for the recurrences of longdoc.parallel.recurrent, and random inputs.

    x, dt, B, C = ssd_inputs(batch=2, length=40, heads=4, groups=1, seed=0, decay="near1")
    y, final = ssd_sequential(x, dt, A, B, C, D=D, dt_bias=..., softplus=True)   # token by token

`decay` picks the time steps so that exp(A * dt) is close to 1 ("near1": the state remembers everything),
close to 0 ("near0": it forgets at once) or spread ("mixed").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _dt(shape, decay: str, g: torch.Generator, dtype) -> torch.Tensor:
    if decay == "near1":
        return torch.rand(shape, generator=g, dtype=dtype) * 1e-3
    if decay == "near0":
        return 5 + torch.rand(shape, generator=g, dtype=dtype) * 5
    return torch.rand(shape, generator=g, dtype=dtype) * 2


def ssd_inputs(batch, length, heads, head_dim, groups, state, seed=0, decay="mixed", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, head_dim, generator=g, dtype=dtype)
    dt = _dt((batch, length, heads), decay, g, dtype)
    B = torch.randn(batch, length, groups, state, generator=g, dtype=dtype)
    C = torch.randn(batch, length, groups, state, generator=g, dtype=dtype)
    A = -(0.5 + torch.rand(heads, generator=g, dtype=dtype))
    return x, dt, A, B, C


def ssd_sequential(x, dt, A, B, C, D=None, dt_bias=None, softplus=False, dt_limit=(0.0, float("inf")),
                   initial=None):
    """Mamba2 SSD token by token: h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t."""
    b, length, heads, p = x.shape
    rep = heads // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    if dt_bias is not None:
        dt = dt + dt_bias
    if softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(*dt_limit)
    h = torch.zeros(b, heads, p, B.shape[-1], dtype=x.dtype) if initial is None else initial.clone()
    ys = []
    for t in range(length):
        h = torch.exp(A * dt[:, t])[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        y = torch.einsum("bhpn,bhn->bhp", h, Ch[:, t])
        ys.append(y + (D[:, None] * x[:, t] if D is not None else 0))
    return torch.stack(ys, dim=1), h


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
             return_final_states=False, initial_states=None, **kwargs):
    """ssd_sequential with mamba_chunk_scan_combined's signature (a float64 stand-in for the local scan)."""
    y, h = ssd_sequential(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_states)
    return (y, h) if return_final_states else y


def selective_inputs(batch, length, channels, state, seed=0, decay="mixed", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=g, dtype=dtype)
    dt = _dt((batch, channels, length), decay, g, dtype)
    A = -(0.5 + torch.rand(channels, state, generator=g, dtype=dtype))
    B = torch.randn(batch, state, length, generator=g, dtype=dtype)
    C = torch.randn(batch, state, length, generator=g, dtype=dtype)
    z = torch.randn(batch, channels, length, generator=g, dtype=dtype)
    return x, dt, A, B, C, z


def selective_sequential(x, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial=None):
    """Mamba1 token by token: h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t, y_t = (h_t C_t + D x_t) silu(z_t)."""
    if delta_bias is not None:
        dt = dt + delta_bias[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    b, d, length = x.shape
    h = torch.zeros(b, d, A.shape[-1], dtype=x.dtype) if initial is None else initial.clone()
    ys = []
    for t in range(length):
        h = torch.exp(A[None] * dt[:, :, t, None]) * h + dt[:, :, t, None] * B[:, None, :, t] * x[:, :, t, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + x * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y, h


def selective_scan(x, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False,
                   **kwargs):
    """selective_sequential with selective_scan_fn's signature."""
    y, h = selective_sequential(x, dt, A, B, C, D, z, delta_bias, delta_softplus)
    return (y, h) if return_last_state else y


def causal_conv(x, weight, bias=None):
    """Depthwise causal conv over the last dim: x (b, channels, L), weight (channels, K)."""
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]


def split_docs(x, doc_lens, dim):
    """x cut into its documents along `dim`."""
    return list(x.split(list(doc_lens), dim=dim))


class DenseToy:
    """A dense recurrence S_t = M_t S_{t-1} + u_t, y_t = c_t . S_t (the shape of the delta rules): summary
    (T, U) with T the product of the M_t; `finish` re-runs the piece from its state. Inputs: M (b, L, k, k),
    u (b, L, k), c (b, L, k)."""

    @staticmethod
    def scan(M, u, c, state=None):
        s = torch.zeros_like(u[:, 0]) if state is None else state
        T = torch.eye(M.shape[-1], dtype=M.dtype).expand_as(M[:, 0])
        ys = []
        for t in range(M.shape[1]):
            s = torch.einsum("bij,bj->bi", M[:, t], s) + u[:, t]
            T = torch.einsum("bij,bjk->bik", M[:, t], T)
            ys.append((c[:, t] * s).sum(-1))
        return torch.stack(ys, dim=1), s, T

    def local(self, piece):
        y, s, T = self.scan(*piece)
        return y, (T, s)

    def advance(self, state, summary):
        T, U = summary
        return (U,) if state is None else (torch.einsum("bij,bj->bi", T, state[0]) + U,)

    def finish(self, piece, y0, state):
        return self.scan(*piece, state=state[0])[0]


def dense_inputs(batch, length, k, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(batch, length, k, k, generator=g, dtype=dtype) * (0.9 / k ** 0.5)
    return M, torch.randn(batch, length, k, generator=g, dtype=dtype), torch.randn(batch, length, k, generator=g,
                                                                                  dtype=dtype)
