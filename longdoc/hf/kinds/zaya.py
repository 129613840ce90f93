"""ZAYA's compressed convolutional attention projection (ZayaCCAProjection): q/k mixed by two causal convs, v
half from the previous token. Under CP the convs get a halo of their conv_kernel_size previous inputs and the
delayed value the previous token of its document (v_proj_delayed of zeros at a document start, as one process
does), from whichever rank holds them. The attention itself is the layer's own, through the CP backend.

A mixer-level CP forward: the module's projections and convs, in the order of its own forward (transformers 5.24).
"""

from __future__ import annotations

import torch

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Forward, register
from longdoc.parallel.recurrent import Segments, by_row, halo, tail


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:  # (b, kv_heads, L, d) -> (b, kv_heads * n, L, d)
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _row(m, call, seg: Segments, hidden_states, cache):
    cp = call.cp
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, m.head_dim)
    queries, keys = m.q_proj(hidden_states), m.k_proj(hidden_states)
    qk_states = torch.cat([queries, keys], dim=-1).transpose(1, 2)  # (b, channels, L)
    query_residual = queries.view(*hidden_shape)
    key_residual = _repeat_kv(keys.view(*hidden_shape).transpose(1, 2), m.num_key_value_groups).transpose(1, 2)
    query_residual = (query_residual + key_residual) * 0.5
    key_residual = query_residual.view(*input_shape, -1, m.num_key_value_groups, m.head_dim).mean(dim=-2)
    k = m.conv_kernel_size
    ext, keep = halo(qk_states, k, cp, seg, dim=-1)  # one process pads the row with k zeros instead
    qk = m.conv_qk_grouped(m.conv_qk_depthwise(ext)).index_select(-1, keep - k).transpose(1, 2)
    n_query = query_residual.shape[-2] * query_residual.shape[-1]
    query = qk[..., :n_query].view(*hidden_shape) + query_residual
    key = qk[..., n_query:].view(*hidden_shape) + key_residual
    value_current = m.v_proj_current(hidden_states)
    before, keep1 = halo(hidden_states, 1, cp, seg, dim=1)  # the previous token (zeros at a document start)
    value_delayed = m.v_proj_delayed(before).index_select(1, keep1 - 1)
    if cache is not None:  # a session prefill: what decoding continues from, on every rank
        at = call.final_at
        cache.update_conv_state(tail(qk_states, k, cp, seg, at), m.layer_idx, conv_kernel_size=k, gathered=True)
        cache.update_recurrent_state(m.v_proj_delayed(tail(hidden_states, 1, cp, seg, at, dim=1))[:, 0], m.layer_idx)
    value = torch.cat([value_current, value_delayed], dim=-1).view(*hidden_shape)
    return query, key, value


def cp_forward(module, handle, original, hidden_states, cache=None, conv_mask=None):
    if handle.mode == "extend":
        return original(hidden_states, cache, conv_mask)
    if conv_mask is not None:
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    call = recurrent.Call(module, handle)
    segs = call.segments(hidden_states.shape[0], hidden_states.shape[1])
    cache = cache if handle.session is not None else None
    if isinstance(segs, Segments):
        return _row(module, call, segs, hidden_states, cache)
    rows = [_row(module, call, s, hidden_states[sl], None) for sl, s in by_row(segs, hidden_states.shape[0])]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*rows))


KIND = register(Forward(name="zaya_cca", matches=lambda m: type(m).__name__ == "ZayaCCAProjection",
                       forward=cp_forward, hybrid_types=frozenset({"hybrid", "hybrid_sliding"}),
                       replaces_attention=False, packed=True, decode=True))
