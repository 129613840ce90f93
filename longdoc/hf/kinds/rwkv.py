"""RWKV-4 blocks under CP: the time mix (WKV linear attention) and the channel mix (feed-forward).

Both mix each token with the one before it (`time_shift`, an nn.ZeroPad2d), shadowed for the call by a one-token
halo from whichever rank holds the previous token (zeros at a document start). The time mix's WKV
(`rwkv_linear_attention`, a module-level function) is routed to the model's own torch scan (rwkv_linear_attention
_cpu) on every piece entered with its true (numerator, denominator, max) state, from state passing with a
max-stabilised combine (longdoc.parallel.recurrent.rwkv); never the CUDA kernel on a rank's tokens. Everything
else is the module's own forward. RWKV has no layer_types: the kind matches both module classes explicitly.

A fresh `state` (what RwkvModel makes for itself with use_cache=True) is filled with the state at the end of the
row, identical on every rank, as one process would return it; a state to continue from, and decoding, are
refused by name (the KV session does not carry RWKV's own state).
"""

from __future__ import annotations

import sys

from longdoc.hf import recurrent
from longdoc.hf.kinds.primitives import fresh, last_token, shadowed, shift
from longdoc.hf.kinds.registry import Forward, register
from longdoc.parallel.recurrent import run
from longdoc.parallel.recurrent.rwkv import Wkv

_TIME_MIX, _CHANNEL_MIX = "RwkvSelfAttention", "RwkvFeedForward"
_EMPTY = (0.0, 0.0, 0.0, 0.0, -1e30)  # RwkvModel's starting state: shifts, numerator, denominator, max


def forward(module, handle, original, hidden, state=None, use_cache=False):
    time_mix, layer = type(module).__name__ == _TIME_MIX, module.layer_id
    if state is not None and not fresh(*(s[:, :, layer] for s in state), empty=_EMPTY):
        raise RuntimeError("longdoc: an RWKV block under CP got a state to continue from; RWKV decoding under CP "
                           "is not supported (run it without CP)")
    call = recurrent.Call.of(module, handle, {})
    cp, seq_len = call.cp, hidden.shape[1]
    segs = call.segments(hidden.shape[0], seq_len)
    end = seq_len * cp.size if state is not None else None
    ns = sys.modules[type(module).__module__]
    finals = {}

    def cp_wkv(fn, time_decay, time_first, key, value, state=None, return_state=False):
        out = run(Wkv(ns.rwkv_linear_attention_cpu, time_decay, time_first), (key, value), cp, segs, dims=1,
                  out_dim=1, final_at=end)
        finals["wkv"] = out.final
        return out.y, None

    with shadowed(module.time_shift, forward=lambda x: shift(x, cp, segs, dim=1)), \
            recurrent.route(module, {"rwkv_linear_attention": cp_wkv} if time_mix else {}):
        out, _ = original(hidden, state=None, use_cache=False) if time_mix else original(hidden, state=None)
    if state is not None:  # what RwkvModel returns: the state at the end of the row, on every rank
        state[1 if time_mix else 0][:, :, layer] = last_token(hidden, cp, segs, end)
        for i, s in enumerate(finals.get("wkv", ())):
            state[2 + i][:, :, layer] = s
    return out, state


KIND = register(Forward(
    name="rwkv",
    matches=lambda m: type(m).__name__ in (_TIME_MIX, _CHANNEL_MIX),
    forward=forward,
    replaces_attention=True,  # RWKV has no attention layers (nor config.layer_types): both mixes count here
    packed=True,
))
