"""Llama 4's attention temperature tuning (attn_temperature_tuning=True) under CP: from the token's place in its row.

Llama 4 scales the queries of its NoPE layers by  1 + attn_scale * log1p(floor((t + 1) / floor_scale)),  where t is
the token's index in the call (torch.arange over the call's tokens, plus the cached length when decoding). Under CP
a rank's call holds other tokens than one process's, so the module's own scaling would use the wrong t. This kind
runs the attention module with its scaling switched off for the call, and the "longdoc_cp" attention function
applies the same formula to the same queries (before anything else touches them) with t = the token's index in
its row (unpacked: its global index; a left-padded row, rolled by cp.shard_batch, is counted from its first real
token, as that row run on its own; packed: its index in its document, as each document run on its own; decoding:
its global position). The arithmetic is transformers' own, so the scaled queries are bit for bit one process's.
"""

from __future__ import annotations

import torch

from longdoc.hf.kinds.registry import AttentionTweak, register


def _matches(module) -> bool:
    return (type(module).__name__ == "Llama4TextAttention" and bool(getattr(module, "attn_temperature_tuning", False))
            and not getattr(module, "use_rope", True))


def cp_forward(module, handle, original, *args, **kwargs):
    module.attn_temperature_tuning = False  # the attention function scales instead, from each token's row index
    try:
        return original(*args, **kwargs)
    finally:
        module.attn_temperature_tuning = True


def _indices(handle, batch: int, length: int, device, documents) -> torch.Tensor:
    """(batch, length) index of every query of this call in its row (or document), as one process counts it."""
    session = handle.session
    if session is not None:
        cp = session.cp
        if session.mode == "extend":
            start = session.total - length
            return torch.arange(start, start + length, device=device).expand(batch, -1)
        return cp.positions(length * cp.size, device=device).expand(batch, -1)
    cp = handle.cp
    if documents is None:
        return cp.positions(length * cp.size, device=device).expand(batch, -1)
    return torch.stack([cp.shard(d.position_ids(device), dim=0, documents=d) for d in documents])


def scale_queries(module, handle, query: torch.Tensor, documents=None) -> torch.Tensor:
    """query (batch, heads, len, dim) scaled as Llama4TextAttention scales it, at each token's row index;
    documents: the call's packed rows (per row), or None."""
    t = _indices(handle, query.shape[0], query.shape[2], query.device, documents)
    scales = torch.log1p(torch.floor((t.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales[:, None, :, None]).to(query.dtype)


def is_tuned(module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "kind", None), "name", None) == KIND.name


KIND = register(AttentionTweak(
    name="llama4_temperature",
    matches=_matches,
    forward=cp_forward,  # the layer's attention runs, through the "longdoc_cp" backend, which scales the queries
))
