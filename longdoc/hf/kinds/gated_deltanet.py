"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5 dense and MoE, OLMo Hybrid, LaRA mini, Qwen4-exp) under CP.

Each mixer is per-token projections around a causal depthwise conv (`causal_conv1d_fn`) and the chunked delta
rule (`torch_chunk_gated_delta_rule`); the kind runs the module's own forward with those entry points routed
(longdoc.hf.recurrent.route): the conv gets its halo, the scan runs as pieces composed by state passing
(longdoc.parallel.recurrent.delta: the dense k x k transition comes from one run of transformers' own torch
kernel on identity-augmented values, and the output correction reuses that run). Packed rows reset both at
document starts; a KV session's prefill leaves the prompt's final state in its cache (the conv state through
the session's CP-aware cache layers), and decoding runs the module's own cached one-token path on every rank.
The torch path runs on every piece, never a fused kernel (fla / causal-conv1d) on a rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Routed, register
from longdoc.parallel.recurrent import run
from longdoc.parallel.recurrent.delta import DeltaRule

CLASSES = frozenset({"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                     "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet"})


def delta_scan(call: recurrent.Call) -> Callable:
    """The route of a chunked delta-rule kernel `(query, key, value, g, beta, chunk_size=, initial_state=,
    output_final_state=, use_qk_l2norm_in_kernel=)`: exact over this rank's tokens; the final state is the
    prompt's (a session prefill), on every rank."""

    def scan(fn, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **_):
        if initial_state is not None:
            raise RuntimeError("longdoc: a delta-rule scan with an initial state ran on CP-sharded tokens (only a "
                               "decode step continues from a state)")
        rec = DeltaRule(fn, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        segs = call.segments(query.shape[0], query.shape[1])
        final_at = call.final_at if output_final_state else None
        out = run(rec, (query, key, value, g, beta), call.cp, segs, dims=1, out_dim=1, final_at=final_at)
        return out.y.to(query.dtype), (out.final[0] if final_at is not None else None)

    return scan


def kind(name: str, classes: frozenset[str], chunk_fn: str, step_fn: str) -> Routed:
    """A delta-rule kind, registered: mixers of `classes` whose modeling module calls causal_conv1d_fn and
    `chunk_fn` (the one-token `step_fn` and causal_conv1d_update only in decoding, which runs the module's own
    cached path); a forward on sharded tokens must route both the conv and the scan."""

    def routes(call: recurrent.Call) -> dict:
        return {"causal_conv1d_fn": call.conv, chunk_fn: delta_scan(call),
                "causal_conv1d_update": recurrent.never("causal_conv1d_update"), step_fn: recurrent.never(step_fn)}

    return register(Routed(name=name, classes=classes, routes=routes,
                           routed=frozenset({"causal_conv1d_fn", "causal_conv1d_update", chunk_fn, step_fn}),
                           required=frozenset({"causal_conv1d_fn", chunk_fn}),
                           layer_types=frozenset({"linear_attention"})))


KIND = kind("gated_deltanet", CLASSES, "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
