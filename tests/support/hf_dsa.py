"""Tiny random-init models of the sparse indexed attention (DSA) families, built from transformers' own configs.

    ref, model = dsa_pair("deepseek_v32")        # identical weights; the reference runs eager attention

TOPK keys per query, far below the tests' lengths, so the selection is really sparse; two index heads, so many
keys score exactly 0 (every head's relu at 0) and ties at the k-th place are common: the tests see them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from tests.support.hf_cases import eager_causal_lm, twin_pair

TOPK = 8
_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=256, max_position_embeddings=4096, initializer_range=0.1, index_topk=TOPK, index_head_dim=16,
    index_n_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
    mlp_layer_types=["dense", "sparse", "sparse"], tie_word_embeddings=False)

_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
               image_size=28, patch_size=14)
# model_type -> (config overrides, how the config is built: "plain", "text" (the family's <type>_text config,
# whose causal LM is the text model) or "vision" (an image-text model run on text: a tiny vision tower)).
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "deepseek_v32": ({}, "plain"),  # MLA + indexer with half-split RoPE
    "glm_moe_dsa": (dict(indexer_types=["full", "shared", "full"]), "plain"),  # interleaved RoPE, shared top-k
    "hy_v4": ({}, "plain"),  # flipped RoPE slice, fp32 key norm, scale folded into the weights, sinks, gates
    "axk2": (dict(n_group=None, topk_group=None), "plain"),
    # DSA beside a sliding layer (its own per-layer MLA shape: swa_*), gated heads; dots3 turns "full_attention"
    # layers into "indexed_attention" ones
    "dots3_note": (dict(layer_types=["sliding_attention", "indexed_attention", "full_attention"], sliding_window=5,
                        num_local_experts=4, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32,
                        swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16,
                        shared_experts_intermediate_size=64), "text"),
    "mistral_large4": (dict(no_rope_layers=[1, 0, 1], indexer_types=["full", "shared", "full"],
                            first_k_dense_replace=1), "vision"),  # NoPE layers, softmax scaling by position
}
FAMILIES["dots3_note_text"] = FAMILIES["dots3_note"]  # the same causal LM, under its text config's type (survey)
TESTED = tuple(k for k in FAMILIES if k != "dots3_note_text")  # each family once
ACCEPTANCE = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")


def dsa_config(arch: str, **overrides: Any):
    extra, how = FAMILIES[arch]
    fields = {**_COMMON, **extra, **overrides}
    if how == "vision":
        config = AutoConfig.for_model(arch, text_config=fields, vision_config=_VISION)
    else:
        config = AutoConfig.for_model(f"{arch.removesuffix('_text')}_text" if how == "text" else arch, **fields)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in vars(c).items():
            if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
                setattr(c, key, 0.0)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(getattr(c, key, None), int) and getattr(c, key) >= 256:
                setattr(c, key, 255)
    return config


def _model(config) -> PreTrainedModel:
    """The family's model, eager attention and experts, every weight random."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:  # image-text models (Mistral Large 4): the conditional-generation class, used on text
        from transformers import AutoModelForImageTextToText
        model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager",
                                                        experts_implementation="eager")
    else:
        model = eager_causal_lm(config)
    for name, p in model.named_parameters():  # HF inits some DSA weights to 0 / 1: make every one count
        if "softmax_scaling" in name or "e_score_correction_bias" in name:
            p.data.normal_(0.0, 0.3)
    return model


def dsa_pair(arch: str, seed: int = 1, dtype: torch.dtype = torch.float32,
             **overrides: Any) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, twin to patch) with identical weights; eager attention and experts."""
    return twin_pair(dsa_config(arch, **overrides), seed, dtype, build=_model)
