"""Short causal convolutions (LFM2's gated short conv: lfm2, lfm2_moe, lfm3; inkling's short convolution).

Each module runs its own forward; its conv (causal_conv1d_fn) gets a halo of kernel-1 tokens of the same
document from whichever ranks hold them (zeros at a document start). No state beyond the conv cache.
"""

from __future__ import annotations

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Routed, register

MIXERS = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"})
ROUTED = frozenset({"causal_conv1d_fn", "causal_conv1d_update"})


def _routes(call: recurrent.Call) -> dict:
    return {"causal_conv1d_fn": call.conv, "causal_conv1d_update": recurrent.never("causal_conv1d_update")}


KIND = register(Routed(name="shortconv", classes=MIXERS, routes=_routes, routed=ROUTED,
                       required=frozenset({"causal_conv1d_fn"}), layer_types=frozenset({"conv"})))
