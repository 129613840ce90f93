"""The tiny random-init models the tests use: one small config per architecture, built from config alone.

    model = tiny_model("mixtral", seed=1)            # vocab 256, identical for identical arguments
    config = tiny_config("qwen3", num_hidden_layers=3)
    models.load("tiny:qwen3")                        # the same model with the default tokenizer's vocabulary
    models.load("tiny:gemma2")                       # a family with its patterns on (window 32, soft-capping)

The names and their configs are in longdoc.models.zoo. Every architecture here routes attention through transformers'
AttentionInterface, so CP can patch it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from longdoc.models import zoo

TINY_PREFIX = "tiny:"

# The names live in longdoc.models.zoo (plain data, so --help lists them without importing transformers).
TINY_ARCHS: tuple[str, ...] = tuple(zoo.PLAIN)  # the plain test zoo (model_type = name, full attention)
TINY_PATTERN_ARCHS: tuple[str, ...] = tuple(zoo.PATTERNED)  # families with windows / sinks / soft-caps / chunks on
TINY_HYBRIDS: tuple[str, ...] = tuple(zoo.HYBRID)  # state-space / conv layers (longdoc.hf.kinds)
TINY_SPARSE: tuple[str, ...] = tuple(zoo.SPARSE)  # sparse indexed attention (DSA)
TINY_NAMES: tuple[str, ...] = zoo.NAMES


def _unknown(arch: str, name: str | None = None) -> ValueError:
    import difflib

    close = difflib.get_close_matches(arch, TINY_NAMES, n=1, cutoff=0.6)
    return ValueError(f"unknown tiny architecture {arch!r}" + (f" in {name!r}" if name else "")
                      + f" (choose from {', '.join(TINY_NAMES)})" + (f"; did you mean {close[0]!r}?" if close else ""))


def arch_of(name: str) -> str:
    """The architecture of a "tiny:<arch>" name, or an error listing the known ones."""
    arch = name[len(TINY_PREFIX) :]
    if arch not in TINY_NAMES:
        raise _unknown(arch, name)
    return arch


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """A tiny fp32-friendly config of `arch` (one of TINY_NAMES): hidden 64, 2 layers, 4 q / 2 kv heads.

    No dropout anywhere; the plain archs (TINY_ARCHS) have no sliding window unless `overrides` ask for one,
    the patterned ones (TINY_PATTERN_ARCHS) have theirs on (longdoc.models.zoo).
    """
    if arch in zoo.PLAIN:
        model_type, own = arch, zoo.PLAIN[arch]
    elif arch in zoo.PATTERNED or arch in zoo.HYBRID or arch in zoo.SPARSE:
        model_type, own, _ = zoo.PATTERNED.get(arch) or zoo.HYBRID.get(arch) or zoo.SPARSE[arch]
    else:
        raise _unknown(arch)
    fields = {**zoo.COMMON, **own, **overrides}
    # Several archs default special ids far above the tiny vocab (phi3: 32000); keep them inside it.
    defaults = AutoConfig.for_model(model_type)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = fields.get(key, getattr(defaults, key, None))
        if isinstance(value, int) and value >= fields["vocab_size"]:
            fields[key] = fields["vocab_size"] - 1
    config = AutoConfig.for_model(model_type, **fields)
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
    attn_implementation: str | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A random-init tiny causal LM, identical for identical (arch, seed, overrides); attention as `from_config`
    picks it (sdpa where the class supports it, else eager)."""
    return from_config(tiny_config(arch, **overrides), seed=seed, dtype=dtype, attn_implementation=attn_implementation)


def from_config(config: PretrainedConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                attn_implementation: str | None = None, **kwargs: Any) -> PreTrainedModel:
    """A random-init causal LM of `config`, identical for identical (config, seed): the one random-init loader.

    attn_implementation None lets transformers pick what the class accepts (sdpa where `_supports_sdpa`, else
    eager: Gemma 2, GPT-OSS, Mamba, ...); longdoc.patch replaces attention anyway, so the choice only matters
    unpatched, and a model longdoc cannot shard is refused by longdoc.patch by name, not by a loader error.
    """
    # Initialise in fp32 under a private RNG so the weights depend on the seed only (not on the
    # caller's RNG state), and a bf16 model is exactly the fp32 one cast.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation,
                                                 **kwargs)
    return model.to(dtype)

