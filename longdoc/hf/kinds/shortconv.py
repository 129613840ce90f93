"""Short causal convolutions (LFM2's gated short conv: lfm2, lfm2_moe, lfm3; inkling's short convolution).

Each module runs its own forward; its conv (causal_conv1d_fn) gets a halo of kernel-1 tokens of the same
document from whichever ranks hold them (zeros at a document start). No state beyond the conv cache.
"""

from __future__ import annotations

from longdoc.hf import recurrent
from longdoc.hf.kinds.base import LayerKind

MIXERS = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"})
ROUTED = frozenset({"causal_conv1d_fn", "causal_conv1d_update"})


def _routes(call: recurrent.Call) -> dict:
    return {"causal_conv1d_fn": call.conv, "causal_conv1d_update": recurrent.never("causal_conv1d_update")}


def cp_forward(module, handle, original, *args, **kwargs):
    return recurrent.forward(module, handle, original, args, kwargs, _routes, frozenset({"causal_conv1d_fn"}))


KIND = LayerKind(name="shortconv", matches=lambda m: type(m).__name__ in MIXERS, forward=cp_forward,
                 layer_types=frozenset({"conv"}), problem=lambda m, h: recurrent.unrouted(m, ROUTED),
                 replaces_attention=True, packed=True, decode=True)
