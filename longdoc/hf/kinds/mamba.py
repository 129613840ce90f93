"""Mamba1 (selective scan) mixers: mamba, falcon_mamba, jamba, zamba.

Each mixer runs its own forward; its conv (causal_conv1d_fn) gets a halo of kernel-1 tokens and its scan
(mamba_selective_scan, which takes no initial state) runs piece by piece from zero with the closed-form
correction of longdoc.parallel.recurrent.Selective (per-channel, per-state decay), then the output gate.
"""

from __future__ import annotations

import torch.nn.functional as F

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Routed, register
from longdoc.parallel.recurrent import Selective, run

MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"})
ROUTED = frozenset({"causal_conv1d_fn", "mamba_selective_scan", "mamba_inner_fn", "causal_conv1d_update",
                    "mamba_selective_state_update"})


def _scan(call: recurrent.Call):
    def scan(fn, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             return_last_state=False, **kwargs):
        rec = Selective(fn, A, D, delta_bias, delta_softplus, tuple(sorted(kwargs.items())))
        segs = call.segments(hidden_states.shape[0], hidden_states.shape[-1])
        out = run(rec, (hidden_states, dt, B, C), call.cp, segs, dims=2, out_dim=2,
                  final_at=call.final_at if return_last_state else None)
        y = out.y.to(rec.out_dtype(hidden_states))  # fp32 until here: rounded once, as one process does
        y = y if z is None else y * F.silu(z)  # the gate, as the scan applies it after the state
        return (y, out.final[0]) if return_last_state else y
    return scan


def _routes(call: recurrent.Call) -> dict:
    return {"causal_conv1d_fn": call.conv, "mamba_selective_scan": _scan(call),
            "mamba_inner_fn": recurrent.unfused,
            "causal_conv1d_update": recurrent.never("causal_conv1d_update"),
            "mamba_selective_state_update": recurrent.never("mamba_selective_state_update")}


REQUIRED = frozenset({"causal_conv1d_fn", "mamba_selective_scan"})


KIND = register(Routed(name="mamba", classes=MIXERS, routes=_routes, routed=ROUTED, required=REQUIRED,
                       layer_types=frozenset({"linear_attention"}), hybrid_types=frozenset({"hybrid"})))
