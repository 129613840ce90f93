"""Mamba2 (SSD) mixers: mamba2, bamba, granitemoehybrid (Granite 4.0-H), falcon_h1, zamba2, nemotron_h.

Each mixer runs its own forward; its conv (causal_conv1d_fn) gets a halo of kernel-1 tokens and its scan
(mamba2_chunk_scan) runs piece by piece with state passing (longdoc.parallel.recurrent.SSD: per-head scalar
decay, an additive output correction), so any CP size works whatever the number of heads or groups. The fully
fused layer kernel is routed to the unfused path; one-token cached updates run only in decoding.
"""

from __future__ import annotations

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Routed, register
from longdoc.parallel.recurrent import SSD, run

MIXERS = frozenset({"Mamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "Zamba2MambaMixer",
                    "NemotronHMamba2Mixer"})
PARALLEL = frozenset({"FalconH1Mixer"})  # runs beside the layer's attention


def _ssd(call: recurrent.Call):
    def ssd(fn, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        if initial_states is not None:
            raise RuntimeError("longdoc: an SSD scan with an initial state ran on CP-sharded tokens (only a "
                               "decode step continues from a state)")
        rec = SSD(fn, A, chunk_size, D, dt_bias, dt_softplus, tuple(dt_limit))
        segs = call.segments(hidden_states.shape[0], hidden_states.shape[1])
        out = run(rec, (hidden_states, dt, B, C), call.cp, segs, dims=1, out_dim=1,
                  final_at=call.final_at if return_final_states else None)
        return (out.y, out.final[0]) if return_final_states else out.y
    return ssd


def _routes(call: recurrent.Call) -> dict:
    return {"causal_conv1d_fn": call.conv, "mamba2_chunk_scan": _ssd(call),
            "mamba2_split_conv1d_scan_combined": recurrent.unfused,
            "causal_conv1d_update": recurrent.never("causal_conv1d_update"),
            "mamba2_selective_state_update": recurrent.never("mamba2_selective_state_update")}


ROUTED = frozenset({"causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined",
                    "causal_conv1d_update", "mamba2_selective_state_update"})


REQUIRED = frozenset({"causal_conv1d_fn", "mamba2_chunk_scan"})


KIND = register(Routed(name="mamba2", classes=MIXERS, routes=_routes, routed=ROUTED, required=REQUIRED,
                       layer_types=frozenset({"linear_attention", "moe", "mlp"}), hybrid_types=frozenset({"hybrid"})))
KIND_PARALLEL = register(Routed(name="mamba2_parallel", classes=PARALLEL, routes=_routes, routed=ROUTED,
                                required=REQUIRED, hybrid_types=frozenset({"hybrid"}), replaces_attention=False))
