"""Tiny random-init hybrid models (recurrent / SSM / convolution layers mixed with attention), built from
transformers' own configs, for the CP-vs-one-process tests of longdoc.hf.kinds.

    ref, model = hybrid_pair("granitemoehybrid")    # identical weights; eager attention (the reference)

Layer mixes follow the real models' shapes at toy size (e.g. Granite 4.0-H: Mamba2 layers with an attention
layer between, MoE MLPs). Mamba layers use n_groups=1 (and 2 in VARIANTS) with 8 heads, so CP sizes above
the group count are covered. Add a family: one entry in HYBRIDS (model_type -> config overrides).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from tests.support.hf_cases import twin_pair

_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=256, max_position_embeddings=4096, initializer_range=0.1)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=8)
_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2)

# model_type -> config overrides (the comment names the real model's mixer)
HYBRIDS: dict[str, dict[str, Any]] = {
    "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=1, state_size=16, expand=2,
                   conv_kernel=4, chunk_size=8),  # Mamba2 (SSD)
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA),  # Mamba2 + attention
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3,
                             shared_intermediate_size=64, **_MAMBA, **_MOE),  # Granite 4.0-H: Mamba2 + attention, MoE
    "falcon_h1": dict(num_hidden_layers=2, mamba_d_ssm=128, **_MAMBA),  # Falcon-H1: Mamba2 beside attention
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "moe", "mamba"], num_hidden_layers=4,
                       mamba_num_heads=8, mamba_head_dim=16, n_groups=1, ssm_state_size=16, conv_kernel=4,
                       expand=2, chunk_size=8, n_routed_experts=4, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, num_experts_per_tok=2, n_group=1, topk_group=1),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba"], num_hidden_layers=3, n_mamba_heads=8,
                   mamba_ngroups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, chunk_size=8, num_mem_blocks=1,
                   attention_head_dim=32),  # Zamba2: Mamba2 + a shared attention block
    "mamba": dict(num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=8),  # Mamba1
    "falcon_mamba": dict(num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=8),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                  use_mamba_kernels=False, **_MOE),  # Jamba: Mamba1 + attention, MoE
    "zamba": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, attention_head_dim=32,
                  use_mamba_kernels=False),  # Zamba: Mamba1 heads + a shared attention block
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),  # LFM2
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                     num_dense_layers=1, moe_intermediate_size=32, **_MOE),
    "zaya": dict(num_hidden_layers=2, layer_types=["hybrid", "hybrid_sliding"], sliding_window=7, num_experts=4,
                 num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=32, cca_time0=3, cca_time1=2,
                 attention_bias=True),  # ZAYA: CCA (convs over q/k, a one-token-delayed v) + attention
    "lfm3": dict(num_hidden_layers=4, layer_types=["conv", "sliding_attention", "conv", "full_attention"],
                 conv_L_cache=3, sliding_window=7),
}


# name -> (model_type, overrides over its HYBRIDS entry): Mamba2 with 2 groups of B/C (each group shared by 4 of the
# 8 heads), as real checkpoints have them (Nemotron-H: 8 groups), at CP sizes equal to and above the group count
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2/2 groups": ("mamba2", dict(n_groups=2)),
    "nemotron_h/2 groups": ("nemotron_h", dict(n_groups=2)),
}


def hybrid_config(arch: str, **overrides: Any):
    """The tiny config of a HYBRIDS model type or of a VARIANTS name."""
    arch, variant = VARIANTS.get(arch, (arch, {}))
    config = AutoConfig.for_model(arch, **{**_COMMON, **HYBRIDS[arch], **variant, **overrides})
    for key, value in vars(config).items():
        if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
            setattr(config, key, 0.0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)
    return config


def hybrid_pair(arch: str, seed: int = 1, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, twin to patch) with identical weights; eager attention and experts."""
    return twin_pair(hybrid_config(arch, **overrides), seed, dtype)


def every_expert(arch: str) -> dict[str, Any]:
    """Config overrides that route every token to every expert (top-k = the number of experts), {} for a model
    without experts. A top-k choice is a discrete jump: where two router logits are within a bf16 rounding, which
    expert a token gets depends on the order of the additions before it. Measured on Granite-4-H and Jamba here, one
    token of the 80 took another expert under longdoc's (equally valid) Mamba scan than under transformers', at cp=1
    as at cp=2 and 3, and moved CP 0.14 / 0.3 from one process (logits / gradients, largest entry); top-2 failed the
    bf16 check on 6 of 48 seeds and world sizes, routing to all experts on none of 72. So the bf16 comparisons route
    to every expert: the router's weights and gradient and every expert still run, and a rounding moves them
    continuously."""
    config = hybrid_config(arch)
    if getattr(config, "num_experts_per_tok", None) is None:
        return {}
    return {"num_experts_per_tok": next(getattr(config, k) for k in ("num_local_experts", "num_experts")
                                        if getattr(config, k, None))}
