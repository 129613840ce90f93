"""The tiny random-init architectures behind "tiny:<name>", by name: plain data with no imports, so every
`--help` lists them without loading transformers (longdoc.models.tiny builds them).

The tables, one entry per name:
  PLAIN     the unit-test zoo: full causal attention on every layer, model_type = the name. Tests loop over
            these and compare with sdpa, so they stay plain (a window here would change their numbers).
  PATTERNED families with their attention patterns ON: name -> (model_type, config overrides, what it
            exercises). Windows and chunks are WINDOW tokens, shorter than any sensible --seq-len, so every
            sliding / chunked layer really hides keys. A new family (e.g. a hybrid one, once longdoc shards its
            layers) is one more entry here. HYBRID and SPARSE have the same shape (recurrent / conv layers; DSA).
Both add to COMMON (hidden 64, 2 layers, 4 query / 2 KV heads of 16, vocab 256, 128k positions).
"""

from __future__ import annotations

from typing import Any

WINDOW = 32  # tokens of every tiny sliding window and chunk

COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=131072,
    # 0.02 (the usual default) makes attention almost uniform at hidden 64, so a wrong position or
    # mask would barely move the logits; 0.1 keeps CP-vs-reference tests sensitive.
    initializer_range=0.1,
)

# stablelm has partial rotary (25% of head_dim); qwen2_moe and mixtral are MoE. Windows are off here.
PLAIN: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": dict(sliding_window=None, use_sliding_window=False),
    "qwen3": dict(sliding_window=None, use_sliding_window=False),
    "gemma": {},
    "phi3": dict(sliding_window=None),
    "stablelm": dict(partial_rotary_factor=0.25),
    "qwen2_moe": dict(
        sliding_window=None,
        use_sliding_window=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "mixtral": dict(sliding_window=None, num_local_experts=4, num_experts_per_tok=2),
}

_SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

PATTERNED: dict[str, tuple[str, dict[str, Any], str]] = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW), f"sliding window {WINDOW} on every layer"),
    "gemma2": ("gemma2", dict(_SLIDING, attn_logit_softcapping=5.0),
               f"sliding window {WINDOW} / full layers, attention logit soft-capping 5"),
    "gemma3": ("gemma3_text", dict(_SLIDING), f"sliding window {WINDOW} / full layers"),
    "gpt_oss": ("gpt_oss", dict(_SLIDING, **_MOE), f"sliding window {WINDOW} / full layers, attention sinks, MoE"),
    "llama4": ("llama4_text", dict(attention_chunk_size=WINDOW, no_rope_layers=[1, 0], attn_temperature_tuning=False,
                                   intermediate_size_mlp=128, **_MOE),
               f"chunked local attention of {WINDOW} / full (NoPE) layers, MoE"),
}

# Hybrid families (state-space / convolution layers, with or without attention layers), which longdoc.patch runs
# through longdoc.hf.kinds by state passing; same shape as PATTERNED. Kept out of PLAIN, the attention-only zoo.
HYBRID: dict[str, tuple[str, dict[str, Any], str]] = {
    "mamba2": ("mamba2", dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, expand=2, conv_kernel=4,
                              chunk_size=8), "Mamba2 (SSD) layers only, exact by state passing"),
    "granitemoehybrid": ("granitemoehybrid", dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                                  mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                                                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                                  mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
                                                  shared_intermediate_size=64),
                         "Granite 4.0-H's layer mix: Mamba2, attention, MoE"),
}

# Sparse indexed attention (DSA: a lightning indexer keeps each query's top-k keys), same shape as PATTERNED.
# index_topk 8 is far below any sensible --seq-len, so the selection really is sparse; MLA attention, MoE MLPs.
SPARSE: dict[str, tuple[str, dict[str, Any], str]] = {
    "deepseek_v32": ("deepseek_v32", dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, index_topk=8,
                                          index_head_dim=16, index_n_heads=2, q_lora_rank=32, kv_lora_rank=16,
                                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                                          mlp_layer_types=["dense", "sparse", "sparse"], tie_word_embeddings=False),
                     "DeepSeek-V3.2 sparse attention: top-8 selected keys per query, MLA, MoE"),
}

NAMES: tuple[str, ...] = (*PLAIN, *PATTERNED, *HYBRID, *SPARSE)


def describe() -> str:
    """Every name, the patterned ones with what they exercise: for --help texts."""
    return ", ".join(PLAIN) + "; with attention patterns on: " + "; ".join(
        f"{name} ({what})" for name, (_, _, what) in PATTERNED.items()) + "; hybrid: " + "; ".join(
        f"{name} ({what})" for name, (_, _, what) in HYBRID.items()) + "; sparse: " + "; ".join(
        f"{name} ({what})" for name, (_, _, what) in SPARSE.items())
