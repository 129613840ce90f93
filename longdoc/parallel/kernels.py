"""Local block attention: (out, logsumexp) forward and its backward from (out, logsumexp).

Ring and all-gather attention call these on blocks of the full attention matrix and merge the
partial results; the backward of a block is computed from the *final* output and log-sum-exp, which
makes the per-block gradients add up to the exact full gradient.

Shapes: q (batch, q_heads, q_len, head_dim); k, v (batch, kv_heads, kv_len, head_dim);
out like q; lse (batch, q_heads, q_len) in fp32 (fp64 for fp64 inputs).
`causal` is top-left aligned: query i sees keys j <= i (only used on square diagonal blocks).

Kernels: CPU -> aten flash-for-cpu ops (GQA native); CUDA -> aten flash (bf16/fp16) or
memory-efficient (fp32) ops, or flash-attn when installed; "math" is a plain-torch reference that
runs on any device and dtype. `select` picks one; `ContextParallel(kernel=...)` overrides it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longdoc.parallel.layout import round_up

aten = torch.ops.aten

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Forward
    backward: Backward


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- CPU: aten flash attention for CPU --------------------------------------------------------

def _cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    dout, out = dout.contiguous(), out.contiguous()
    lse = lse.to(_lse_dtype(q.dtype)).contiguous()
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
    )
    return dq, dk, dv


# ---- math reference: any device, any dtype ----------------------------------------------------

def _grouped(q, kv_heads):
    b, hq, lq, d = q.shape
    return q.reshape(b, kv_heads, hq // kv_heads, lq, d)  # (batch, kv_heads, group, q_len, head_dim)


def _math_probs(q, k, causal, scale):
    acc = _lse_dtype(q.dtype)
    qg = _grouped(q, k.shape[1]).to(acc)
    s = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # (b, hkv, g, lq, lk)
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # A row with no visible key has lse = -inf; its probabilities are 0, not exp(-inf + inf) = NaN.
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return p, lse


def _math_forward(q, k, v, causal, scale):
    p, lse = _math_probs(q, k, causal, scale)
    out = torch.matmul(p, v.to(p.dtype).unsqueeze(2))  # (b, hkv, g, lq, d)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:3])


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    acc = _lse_dtype(q.dtype)
    hkv = k.shape[1]
    qg, dog, og = (_grouped(t, hkv).to(acc) for t in (q, dout, out))
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    s = torch.matmul(qg, kf.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse_g = lse.to(acc).reshape(s.shape[:-1])
    p = torch.exp(s - torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g).unsqueeze(-1))
    dp = torch.matmul(dog, vf.transpose(-1, -2))
    delta = (dog * og).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- CUDA: aten flash / memory-efficient, flash-attn when installed ---------------------------

def _expand_kv(q, k, v):
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v
    # Expanded only here, after communication: K/V travel compact between ranks.
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(dk, k):
    groups = dk.shape[1] // k.shape[1]
    if groups == 1:
        return dk
    b, _, l, d = dk.shape
    return dk.reshape(b, k.shape[1], groups, l, d).sum(2)


def _cuda_flash_forward(q, k, v, causal, scale):
    ke, ve = _expand_kv(q, k, v)
    res = aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    ke, ve = _expand_kv(q, k, v)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, ke, ve, out.contiguous(), lse.float().contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
    )
    return dq, _reduce_kv_grad(dk, k), _reduce_kv_grad(dv, v)


def _cuda_efficient_forward(q, k, v, causal, scale):
    ke, ve = _expand_kv(q, k, v)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, ke, ve, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]].float()  # the kernel pads lse to a multiple of 32 rows


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    ke, ve = _expand_kv(q, k, v)
    padded = round_up(q.shape[2], 32)
    lse_p = torch.zeros(*lse.shape[:2], padded, dtype=torch.float32, device=lse.device)
    lse_p[..., : q.shape[2]] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, ke, ve, None, out.contiguous(), lse_p, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    return dq, _reduce_kv_grad(dk, k), _reduce_kv_grad(dv, v)


def _flash_attn_forward(q, k, v, causal, scale):
    from flash_attn import flash_attn_func

    # flash-attn wants (batch, len, heads, dim) and handles GQA natively.
    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                  softmax_scale=scale, return_attn_probs=True)
    return out.transpose(1, 2), lse.float()


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    _flash_attn_backward(t(dout), t(q), t(k), t(v), t(out), lse.float().contiguous(), dq, dk, dv,
                         dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
                         window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


KERNELS: dict[str, Kernel] = {
    "cpu_flash": Kernel("cpu_flash", _cpu_forward, _cpu_backward),
    "math": Kernel("math", _math_forward, _math_backward),
    "cuda_flash": Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": Kernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward),
    "flash_attn": Kernel("flash_attn", _flash_attn_forward, _flash_attn_backward),
}


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select(device: torch.device, dtype: torch.dtype, override: str | None = None) -> Kernel:
    """The block kernel for tensors on `device` with `dtype` (or `override` by name)."""
    if override is not None:
        if override not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, KERNELS))}, got {override!r}")
        return KERNELS[override]
    if device.type == "cpu":
        return KERNELS["cpu_flash"]
    if device.type == "cuda":
        if dtype in (torch.bfloat16, torch.float16):
            return KERNELS["flash_attn" if flash_attn_available() else "cuda_flash"]
        if dtype == torch.float32:
            return KERNELS["cuda_efficient"]
    return KERNELS["math"]
