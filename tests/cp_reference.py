"""Single-process float64 reference for context-parallel attention tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: relative to the tensor's scale, robust to entries near zero."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_case(seed: int, batch: int, heads: tuple[int, int], seq_len: int, head_dim: int, dtype: torch.dtype):
    """Full q, k, v, dout in `dtype` (identical on every rank for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(batch, hq, seq_len, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, hkv, seq_len, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, hkv, seq_len, head_dim, generator=g).to(dtype)
    dout = torch.randn(batch, hq, seq_len, head_dim, generator=g).to(dtype)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool):
    """Output and (dq, dk, dv) of full-sequence SDPA in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), dq, dk, dv


def cases(head_dims=(64, 128)):
    return list(itertools.product(("zigzag", "contiguous"), (True, False), tuple(HEADS), head_dims,
                                  tuple(DTYPES), ("ring", "allgather")))


def run_case(cp, case, seed: int, chunk: int = 6, batch: int = 2) -> dict[str, float]:
    """Relative errors of CP attention vs the float64 reference for one case, on this rank."""
    import longdoc

    layout, causal, heads, head_dim, dtype_name, strategy = case
    seq_len = chunk * cp.multiple
    q, k, v, dout = make_case(seed, batch, HEADS[heads], seq_len, head_dim, DTYPES[dtype_name])
    ref = reference(q, k, v, dout, causal)
    ql, kl, vl = (cp.shard(t, dim=2).requires_grad_() for t in (q, k, v))
    out = longdoc.attention(ql, kl, vl, cp, causal=causal, strategy=strategy)
    grads = torch.autograd.grad(out, (ql, kl, vl), cp.shard(dout, dim=2))
    names = ("out", "dq", "dk", "dv")
    return {n: rel_err(x, cp.shard(r, dim=2)) for n, x, r in zip(names, (out, *grads), ref)}
