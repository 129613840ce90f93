"""Tiny random-init models of the families whose attention patterns CP computes (windows shorter than
the test sequences, sinks, soft-capping, chunked attention), built from transformers' own configs.

    ref, model = family_pair("gemma3_text")      # identical weights, eager attention (the reference)

The windows / chunks are WINDOW tokens, far below the tests' lengths, so every sliding layer hides keys.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from tests.support.hf_cases import twin_pair

WINDOW = 7
_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
                               initializer_range=0.1)
_SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# model_type -> config overrides; the comment says which pattern the family brings.
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2": dict(_SLIDING, attn_logit_softcapping=20.0),  # window + soft-cap
    "gemma3_text": dict(_SLIDING),
    "gemma4_text": dict(_SLIDING),
    "mistral": dict(sliding_window=WINDOW),  # every layer sliding
    "ministral": dict(_SLIDING),
    "ministral3": dict(sliding_window=WINDOW),
    "olmo3": dict(_SLIDING),
    "cohere2": dict(_SLIDING),
    "cohere2_moe": dict(_SLIDING, **_MOE),
    "exaone4": dict(_SLIDING),
    "exaone_moe": dict(_SLIDING, **_MOE),
    "gpt_oss": dict(_SLIDING, **_MOE),  # window + sinks
    "granite_swa": dict(_SLIDING),  # window + sinks
    "granitemoe_swa": dict(_SLIDING, **_MOE),
    "vaultgemma": dict(_SLIDING, attn_logit_softcapping=20.0),
    "llama4_text": dict(attention_chunk_size=WINDOW, no_rope_layers=[1, 0], attn_temperature_tuning=True,
                        floor_scale=4, attn_scale=0.5, intermediate_size_mlp=128, **_MOE),  # chunked local
    # attention; temperature tuning of the NoPE layer's queries (floor_scale 4: the scale changes every 4 tokens)
    "afmoe": dict(_SLIDING, **_MOE),
    "cwm": dict(_SLIDING),
    "modernbert-decoder": dict(_SLIDING, global_attn_every_n_layers=2, local_attention=WINDOW),
    "gemma3n_text": dict(_SLIDING, num_kv_shared_layers=0, altup_num_inputs=2, laurel_rank=8,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                         activation_sparsity_pattern=[0.0, 0.0]),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),  # sliding layers last
    "mimo_v2_flash": dict(_SLIDING, **_MOE),  # window + sinks
    "flint": dict(_SLIDING, **_MOE),  # window + sinks
}
# A few that cover every pattern, for the quicker checks (decoding, the default-suite world size 3).
CORE_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss", "llama4_text", "mistral")


def family_config(arch: str, **overrides: Any):
    config = AutoConfig.for_model(arch, **{**_COMMON, **FAMILIES[arch], **overrides})
    for key, value in vars(config).items():
        if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)  # attention dropout cannot match across ranks
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)
    return config


def family_pair(arch: str, seed: int = 1, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, twin to patch) with identical weights; eager attention and experts (the reference
    implementation of every pattern, and one that runs in float64)."""
    return twin_pair(family_config(arch, **overrides), seed, dtype)


LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # fp32 tiny models: CP vs one process


def check_model_errors(per_rank: list[list[tuple]]) -> None:
    """Assert every (arch, case, logits err, loss err, grads err) of every rank is within tolerance."""
    failures = []
    for results in per_rank:
        for arch, case, logit_err, loss_err, grad_err in results:
            if not (logit_err <= LOGITS_TOL and loss_err <= LOSS_TOL and grad_err <= GRAD_TOL):
                failures.append(f"{arch} {case}: logits {logit_err:.2e} loss {loss_err:.2e} grads {grad_err:.2e}")
    assert not failures, "CP differs from the single-process reference:\n" + "\n".join(sorted(set(failures)))
