"""Llama 4's attention temperature tuning (attn_temperature_tuning=True) under CP: from the token's place in its row.

Llama 4 scales the queries of its NoPE layers by  1 + attn_scale * log1p(floor((t + 1) / floor_scale)),  where t is
the token's index in the call (torch.arange over the call's tokens, plus the cached length when decoding). Under CP
a rank's call holds other tokens than one process's, so the module's own scaling would use the wrong t. This kind
runs the attention module with its scaling switched off for the call, and the "longdoc_cp" attention function
applies the same formula to the same queries (before anything else touches them; longdoc.hf.query_temperature) with
t = the token's index in its row (unpacked: its global index; a left-padded row, rolled by cp.shard_batch, is counted
from its first real token, as that row run on its own; packed: its index in its document, as each document run on
its own; decoding: its global position). The arithmetic is transformers' own, so the scaled queries are bit for bit
one process's.
"""

from __future__ import annotations

from longdoc.hf.kinds.registry import AttentionTweak, register
from longdoc.hf.query_temperature import KIND_NAME


def _matches(module) -> bool:
    return (type(module).__name__ == "Llama4TextAttention" and bool(getattr(module, "attn_temperature_tuning", False))
            and not getattr(module, "use_rope", True))


def cp_forward(module, handle, original, *args, **kwargs):
    module.attn_temperature_tuning = False  # the attention function scales instead, from each token's row index
    try:
        return original(*args, **kwargs)
    finally:
        module.attn_temperature_tuning = True


KIND = register(AttentionTweak(
    name=KIND_NAME,
    matches=_matches,
    forward=cp_forward,  # the layer's attention runs, through the "longdoc_cp" backend, which scales the queries
))
