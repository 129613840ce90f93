"""The tiny random-init models the tests use: one small config per architecture, built from config alone.

    model = tiny_model("mixtral", seed=1)            # vocab 256, identical for identical arguments
    config = tiny_config("qwen3", num_hidden_layers=3)
    models.load("tiny:qwen3")                        # the same model with the default tokenizer's vocabulary

Every architecture here routes attention through transformers' AttentionInterface, so CP can patch it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

TINY_PREFIX = "tiny:"

# Per-architecture settings on top of _TINY_COMMON; every one routes attention through the
# AttentionInterface. stablelm has partial rotary (25% of head_dim); qwen2_moe and mixtral are MoE.
_TINY_COMMON: dict[str, Any] = dict(
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
_TINY_ARCH: dict[str, dict[str, Any]] = {
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
TINY_ARCHS: tuple[str, ...] = tuple(_TINY_ARCH)


def arch_of(name: str) -> str:
    """The architecture of a "tiny:<arch>" name, or an error listing the known ones."""
    arch = name[len(TINY_PREFIX) :]
    if arch not in _TINY_ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r} in {name!r}; choose one of {', '.join(TINY_ARCHS)}")
    return arch



def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """A tiny fp32-friendly config of `arch` (one of TINY_ARCHS): hidden 64, 2 layers, 4 q / 2 kv heads.

    No dropout anywhere and no sliding window unless `overrides` ask for them.
    """
    if arch not in _TINY_ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    fields = {**_TINY_COMMON, **_TINY_ARCH[arch], **overrides}
    # Several archs default special ids far above the tiny vocab (phi3: 32000); keep them inside it.
    defaults = AutoConfig.for_model(arch)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = fields.get(key, getattr(defaults, key, None))
        if isinstance(value, int) and value >= fields["vocab_size"]:
            fields[key] = fields["vocab_size"] - 1
    config = AutoConfig.for_model(arch, **fields)
    for key, value in vars(config).items():
        # Attention dropout cannot be matched across CP ranks, and the others would make
        # train-mode forwards nondeterministic; all are zero unless asked for.
        if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
            if key not in overrides:
                setattr(config, key, 0.0)
    return config


def tiny_model(
    arch: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """A random-init tiny causal LM, identical for identical (arch, seed, overrides)."""
    config = tiny_config(arch, **overrides)
    # Initialise in fp32 under a private RNG so the weights depend on the seed only (not on the
    # caller's RNG state), and a bf16 model is exactly the fp32 one cast.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.to(dtype)

