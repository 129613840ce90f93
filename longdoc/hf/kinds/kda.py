"""Kimi Delta Attention layers (Kimi Linear, GLM-5-next, Bailing hybrid) under CP.

The delta rule with a per-channel decay: the same mixer shape as Gated DeltaNet (a causal conv around the chunked
kernel `chunk_kimi_delta_attention`), so the same routes and state passing (longdoc.hf.kinds.gated_deltanet).
"""

from __future__ import annotations

from longdoc.hf.kinds.gated_deltanet import kind

CLASSES = frozenset({"KimiLinearDeltaAttention", "Glm5NextTextLinearAttention", "BailingHybridDeltaAttention"})

KIND = kind("kda", CLASSES, "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
