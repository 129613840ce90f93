"""Llama 4's attention temperature at each token's row index: the query scale the "longdoc_cp" backend applies.

Llama 4 scales the queries of its NoPE layers by  1 + attn_scale * log1p(floor((t + 1) / floor_scale)),  where t is
the token's index in the call. Under CP the layer kind longdoc.hf.kinds.temperature switches the module's own
scaling off for the call, and the attention function scales the queries here instead, with t = the token's index in
its row, as one process counts it. This module imports nothing of longdoc, so the attention backend can import it
without running longdoc.hf.kinds (which imports every kind, and through hf.recurrent the backend itself).
"""

from __future__ import annotations

import torch

KIND_NAME = "llama4_temperature"  # the name longdoc.hf.kinds.temperature registers its kind under


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
    """Whether `module`'s forward is swapped for the temperature kind (its queries are scaled here)."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "kind", None), "name", None) == KIND_NAME
