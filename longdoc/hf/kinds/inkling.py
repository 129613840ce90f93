"""Inkling (inkling_text, inkling2_text, inkling2_loop_text): refused by name.

Its short convolutions alone would only need a halo (kinds.shortconv), but every Inkling attention layer adds a
query-dependent relative position bias over the last rel_extent tokens (InklingRelativeLogits) to the attention
scores, which the CP attention core does not compute. This kind exists so that the refusal names that bias
rather than the layer types.
"""

from __future__ import annotations

import re

from longdoc.hf.kinds.registry import Refused, register

_CONVS = re.compile(r"^Inkling(2|2Loop)?(Dynamic)?ShortConvolution$")


def _problem(module, handle):
    return ("Inkling's attention, which adds a query-dependent relative position bias over the last rel_extent "
            "tokens to the scores (InklingRelativeLogits); the CP attention core computes no additive biases",
            "run this model without context parallelism")


KIND = register(Refused(name="inkling", matches=lambda m: bool(_CONVS.match(type(m).__name__)), problem=_problem,
                        hybrid_types=frozenset({"hybrid", "hybrid_sliding"})))
