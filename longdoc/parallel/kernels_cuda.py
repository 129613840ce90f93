"""CUDA block kernels: aten flash (bf16/fp16), aten memory-efficient (fp32; band masks), flash-attn.

Same contract as longdoc/parallel/kernels.py (which registers and selects them). K/V arrive compact
(kv_heads); the aten ops want q_heads, so they are expanded here, after communication, and their
gradients reduced back. flash-attn handles GQA and soft-capping natively. Covered by the
@pytest.mark.gpu tests (tests/dist/test_parallel_attention_gpu.py).
"""

from __future__ import annotations

import importlib.util

import torch

from longdoc.parallel.layout import round_up
from longdoc.parallel.masks import band_bias, band_hidden

aten = torch.ops.aten


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


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
    b, _, n, d = dk.shape
    return dk.reshape(b, k.shape[1], groups, n, d).sum(2)


def flash_forward(q, k, v, causal, scale, band=None, softcap=None, mask=None):
    ke, ve = _expand_kv(q, k, v)
    res = aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def flash_backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None):
    ke, ve = _expand_kv(q, k, v)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, ke, ve, out.contiguous(), lse.float().contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, None, None, scale=scale,
    )
    return dq, _reduce_kv_grad(dk, k), _reduce_kv_grad(dv, v)


def _bias(q, k, band, mask=None):
    if band is None and mask is None:
        return None
    lq, lk = q.shape[2], k.shape[2]
    # The memory-efficient kernel wants the bias rows 16-element aligned: allocate padded, view the rest.
    if mask is None:
        padded = torch.zeros(lq, round_up(lk, 16), dtype=q.dtype, device=q.device)
        padded[:, :lk] = band_bias(lq, lk, band, q.dtype, q.device)
        return padded[:, :lk].expand(q.shape[0], q.shape[1], lq, lk)
    hidden = mask if band is None else mask | band_hidden(lq, lk, band, device=q.device)  # (batch, lq, lk)
    padded = torch.zeros(q.shape[0], 1, lq, round_up(lk, 16), dtype=q.dtype, device=q.device)
    padded[..., :lk] = padded[..., :lk].masked_fill(hidden.unsqueeze(1), float("-inf"))
    return padded[..., :lk].expand(q.shape[0], q.shape[1], lq, lk)


def efficient_forward(q, k, v, causal, scale, band=None, softcap=None, mask=None):
    ke, ve = _expand_kv(q, k, v)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, ke, ve, _bias(q, k, band, mask), True, 0.0,
                                                                   causal, scale=scale)
    return out, lse[..., : q.shape[2]].float()  # the kernel pads lse to a multiple of 32 rows


def efficient_backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None):
    ke, ve = _expand_kv(q, k, v)
    padded = round_up(q.shape[2], 32)
    lse_p = torch.zeros(*lse.shape[:2], padded, dtype=torch.float32, device=lse.device)
    lse_p[..., : q.shape[2]] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    bias = _bias(q, k, band, mask)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, ke, ve, bias, out.contiguous(), lse_p, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    return dq, _reduce_kv_grad(dk, k), _reduce_kv_grad(dv, v)


def flash_attn_forward(q, k, v, causal, scale, band=None, softcap=None, mask=None):
    from flash_attn import flash_attn_func

    # flash-attn wants (batch, len, heads, dim) and handles GQA natively.
    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                  softmax_scale=scale, softcap=softcap or 0.0, return_attn_probs=True)
    return out.transpose(1, 2), lse.float()


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, band=None, softcap=None, mask=None):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    _flash_attn_backward(t(dout), t(q), t(k), t(v), t(out), lse.float().contiguous(), dq, dk, dv,
                         dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
                         window_size_right=-1, softcap=softcap or 0.0, alibi_slopes=None, deterministic=False)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
