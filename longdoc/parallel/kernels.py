"""Local block attention: (out, logsumexp) forward and its backward from (out, logsumexp).

Ring and all-gather attention call these on blocks of the full attention matrix and merge the
partial results; the backward of a block is computed from the *final* output and log-sum-exp, which
makes the per-block gradients add up to the exact full gradient.

Shapes: q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim);
out like q; lse (batch, q_heads, q_len) in fp32 (fp64 for fp64 inputs).
`causal` is top-left aligned: query i sees keys j <= i (only used on square diagonal blocks).
`band=(lo, hi)`: row r sees column c when lo <= c - r <= hi (None = unbounded); the planner
(masks.plan) passes it only on partial blocks, and guarantees every row sees at least one column.
`softcap=c`: scores become c * tanh(s / c) before masking and softmax (Gemma 2).
`mask`: a bool (batch, q_len, kv_len) tensor, True where a key is HIDDEN from a query (shared by the heads):
selected-key attention (longdoc.parallel.selection) passes it with causal=False and no band. A row it hides
entirely comes back as (0, any lse); the caller fixes such rows (selection.fix_unseen). Kernels that take a
band take a mask too.

Kernels: CPU -> aten flash-for-cpu ops (GQA native; a band becomes an additive mask built for that
block only); CUDA -> kernels_cuda (aten flash / memory-efficient, flash-attn when installed);
"math" is a tiled plain-torch kernel (memory bounded) for any device and dtype, and the one that
soft-caps on CPU. `select` picks one; `ContextParallel(kernel=...)` overrides it where it can.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longdoc.parallel import kernels_cuda as cuda
from longdoc.parallel.masks import band_bias, band_hidden

aten = torch.ops.aten

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Band = tuple[int | None, int | None]


@dataclass(frozen=True)
class Kernel:
    """forward(q, k, v, causal, scale, band=None, softcap=None, mask=None) -> (out, lse);
    backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None) -> (dq, dk, dv), in q's
    dtype or (math) unrounded in the accumulator dtype: callers add them into fp32 accumulators.
    `band` / `softcap`: whether the kernel accepts those arguments (`band` also means it accepts `mask`)."""

    name: str
    forward: Forward
    backward: Backward
    band: bool = False
    softcap: bool = False


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype of log-sum-exps and merged outputs for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_lse_dtype = lse_dtype  # the old private name, still imported elsewhere


# ---- CPU: aten flash attention for CPU --------------------------------------------------------

def hidden_bias(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(batch, q_len, kv_len) bool, True = hidden -> additive (batch, 1, q_len, kv_len) mask of `dtype`."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf")).unsqueeze(1)


def _cpu_mask(q, k, band, mask=None):
    if mask is not None:
        if band is not None:
            mask = mask | band_hidden(q.shape[2], k.shape[2], band, device=q.device)
        return hidden_bias(mask, q.dtype)
    return None if band is None else band_bias(q.shape[2], k.shape[2], band, q.dtype, q.device)


def _cpu_forward(q, k, v, causal, scale, band=None, softcap=None, mask=None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                 attn_mask=_cpu_mask(q, k, band, mask), scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None):
    dout, out = dout.contiguous(), out.contiguous()
    lse = lse.to(lse_dtype(q.dtype)).contiguous()
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=_cpu_mask(q, k, band, mask), scale=scale
    )
    return dq, dk, dv


# ---- math: tiled plain torch, any device and dtype, bands and soft-capping ----------------------

_TILE_ELEMENTS = 1 << 22  # scores per tile (16 MB in fp32): memory stays bounded at any length


def _grouped(q, kv_heads):
    b, hq, lq, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, lq, d)  # (batch, kv_heads, group, q_len, head_dim)


def _tiles(q, k):
    lq, lk = q.shape[2], k.shape[2]
    step = max(1, _TILE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * lk))
    return [(r, min(lq, r + step)) for r in range(0, lq, step)]


def _scores(qg, kf, r0, r1, causal, scale, band, softcap, mask=None):
    """Scores of rows [r0, r1) (b, hkv, g, rows, lk) after soft-capping and masking, and tanh (or None)."""
    s = torch.matmul(qg[:, :, :, r0:r1], kf.transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    hidden = band_hidden(r1 - r0, kf.shape[-2], band, causal, r0, s.device)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    if mask is not None:  # (batch, q_len, kv_len): the same for every head
        s = s.masked_fill(mask[:, None, None, r0:r1], float("-inf"))
    return s, t


def _probs(s, lse):
    # A row with no visible key has lse = -inf; its probabilities are 0, not exp(-inf + inf) = NaN.
    return torch.exp(s - torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).unsqueeze(-1))


def _math_forward(q, k, v, causal, scale, band=None, softcap=None, mask=None):
    acc = lse_dtype(q.dtype)
    hkv = k.shape[1]
    qg, kf, vf = _grouped(q, hkv).to(acc), k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    outs, lses = [], []
    for r0, r1 in _tiles(q, k):
        s, _ = _scores(qg, kf, r0, r1, causal, scale, band, softcap, mask)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(_probs(s, lse), vf))
        lses.append(lse)
    out = torch.cat(outs, dim=3) if outs else qg.new_zeros(qg.shape)
    lse = torch.cat(lses, dim=3) if lses else qg.new_full(qg.shape[:-1], float("-inf"))
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:3])


def _math_backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None):
    acc = lse_dtype(q.dtype)
    hkv = k.shape[1]
    qg, dog, og = (_grouped(t, hkv).to(acc) for t in (q, dout, out))
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    lse_g = lse.to(acc).reshape(qg.shape[:-1])
    dq = torch.zeros_like(qg)
    dk = torch.zeros(kf.shape, dtype=acc, device=q.device).squeeze(2)
    dv = torch.zeros_like(dk)
    for r0, r1 in _tiles(q, k):
        s, t = _scores(qg, kf, r0, r1, causal, scale, band, softcap, mask)
        p = _probs(s, lse_g[..., r0:r1])
        do = dog[:, :, :, r0:r1]
        dp = torch.matmul(do, vf.transpose(-1, -2))
        delta = (do * og[:, :, :, r0:r1]).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1 - t * t)  # d/ds of c * tanh(s / c)
        dq[:, :, :, r0:r1] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qg[:, :, :, r0:r1]).sum(2) * scale
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
    # unrounded: every caller adds a block's gradients into an fp32 accumulator (or sums them further), so a
    # half-precision result is rounded once, at the end, as one device's is
    return dq.reshape(q.shape), dk, dv


KERNELS: dict[str, Kernel] = {
    "cpu_flash": Kernel("cpu_flash", _cpu_forward, _cpu_backward, band=True),
    "math": Kernel("math", _math_forward, _math_backward, band=True, softcap=True),
    "cuda_flash": Kernel("cuda_flash", cuda.flash_forward, cuda.flash_backward),
    "cuda_efficient": Kernel("cuda_efficient", cuda.efficient_forward, cuda.efficient_backward, band=True),
    "flash_attn": Kernel("flash_attn", cuda.flash_attn_forward, cuda.flash_attn_backward, softcap=True),
}


def flash_attn_available() -> bool:
    return cuda.flash_attn_available()


def select(device: torch.device, dtype: torch.dtype, override: str | None = None, *, band: bool = False,
           softcap: bool = False) -> Kernel:
    """The block kernel for tensors on `device` with `dtype` (or `override` by name) for blocks that
    need a band mask (`band`) and/or soft-capping (`softcap`). An override that cannot do what the
    block needs yields to the selected kernel for that block only (e.g. cpu_flash never soft-caps)."""
    if override is not None:
        if override not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {override!r}")
        chosen = KERNELS[override]
        if (chosen.band or not band) and (chosen.softcap or not softcap):
            return chosen
    if device.type == "cpu":
        return KERNELS["math" if softcap else "cpu_flash"]
    if device.type == "cuda":
        half = dtype in (torch.bfloat16, torch.float16)
        if softcap:
            return KERNELS["flash_attn" if half and not band and flash_attn_available() else "math"]
        if band:
            return KERNELS["cuda_efficient" if dtype != torch.float64 else "math"]
        if half:
            return KERNELS["flash_attn" if flash_attn_available() else "cuda_flash"]
        if dtype == torch.float32:
            return KERNELS["cuda_efficient"]
    return KERNELS["math"]
