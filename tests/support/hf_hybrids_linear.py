"""Tiny random-init models of the linear-attention and recurrent families (Gated DeltaNet, KDA, lightning
attention, RG-LRU, RWKV-4, mLSTM), built from transformers' own configs, for the CP-vs-one-process tests.

    ref, model = linear_pair("qwen3_next")       # identical weights, eager attention (the reference)

Sizes are the smallest that still exercise every path: more value heads than key heads (GQA in the delta
rule), lightning blocks and mLSTM chunks shorter than the tests' pieces, windows shorter than the sequence.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from tests.support.hf_cases import eager_causal_lm, twin_pair

WINDOW = 7
_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096,
                               initializer_range=0.1, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, n_routed_experts=4, n_shared_experts=1)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], head_dim=16)
_MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8)

# model_type -> config overrides
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(_GDN, **_MOE, decoder_sparse_step=1),
    "qwen3_5_text": dict(_GDN),
    "qwen3_5_moe_text": dict(_GDN, **_MOE),
    "olmo_hybrid": dict(_GDN, num_key_value_heads=4),
    "lara_mini": dict(_GDN, **_MOE, sliding_window=WINDOW,
                      layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
                      num_hidden_layers=4),
    # Qwen4-exp with every layer Gated DeltaNet: its DSA indexed-attention layers and n-gram (PLE) embedding are
    # refused by name (see test_hf_linear); all-linear models build no usable cache, hence use_cache=False
    "qwen4_exp_text": dict(_GDN, **_MOE, layer_types=["linear_attention", "linear_attention"], use_cache=False),
    "kimi_linear": dict(_MLA, **_MOE, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                        num_key_value_heads=4),
    "bailing_hybrid": dict(_MLA, **_MOE, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                           layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                           num_key_value_heads=4, num_experts_per_token=2, num_expert_group=1, topk_group=1,
                           first_k_dense_replace=1),
    # GLM-5-next (a vision-language model) with every text layer KDA, its DSA layers configured away
    "glm5_next": dict(text_config=dict(_COMMON, layer_types=["linear_attention", "linear_attention"],
                                       linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                       mlp_layer_types=["dense", "sparse"], kv_lora_rank=16, q_lora_rank=16,
                                       qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=8, index_n_heads=2,
                                       index_head_dim=8, index_topk=16, num_key_value_heads=4, use_cache=False,
                                       pad_token_id=0, eos_token_id=1, bos_token_id=2),
                      vision_config=dict(hidden_size=32, depth=1, num_heads=2, intermediate_size=64,
                                         out_hidden_size=64), image_token_id=250, video_token_id=251),
    "minimax": dict(_MOE, head_dim=16, block_size=8, layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": dict(lru_width=64, block_types=["recurrent", "attention"], attention_window_size=WINDOW,
                            conv1d_width=4, num_key_value_heads=1, head_dim=16),
    "rwkv": dict(attention_hidden_size=64, context_length=4096),
    "xlstm": dict(num_heads=4, chunk_size=4, embedding_dim=64, num_blocks=2, qk_dim_factor=1.0,
                  use_cache=False),  # head dims 16; its cache update is in place, so no backward with one
}


_NESTED = {"glm5_next"}  # configs given as text_config / vision_config
_CLASSES = {"glm5_next": "Glm5NextForConditionalGeneration"}  # no AutoModelForCausalLM entry


def linear_config(arch: str, **overrides: Any):
    common = {} if arch in _NESTED else _COMMON
    config = AutoConfig.for_model(arch, **{**common, **FAMILIES[arch], **overrides})
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in vars(c).items():
            if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float):
                setattr(c, key, 0.0)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(getattr(c, key, None), int) and getattr(c, key) >= c.vocab_size:
                setattr(c, key, c.vocab_size - 1)
    return config


def linear_model(arch: str, config) -> PreTrainedModel:
    """The family's causal LM built from `config`, eager attention and experts."""
    if arch in _CLASSES:
        import transformers

        return getattr(transformers, _CLASSES[arch])._from_config(config, attn_implementation="eager",
                                                                 experts_implementation="eager")
    return eager_causal_lm(config)


def linear_pair(arch: str, seed: int = 1, dtype: torch.dtype = torch.float32,
                **overrides: Any) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, twin to patch) with identical weights; eager attention and experts."""
    return twin_pair(linear_config(arch, **overrides), seed, dtype, build=lambda config: linear_model(arch, config))


hybrid_config = linear_config  # the name tests/support/survey.py looks up in each family module


# ---- a float64 delta rule: the definition, so that CP and one process are compared at float64 precision ----

def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def sequential_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule one token at a time in the inputs' dtype, with the chunk kernels' signature
    (transformers' torch_chunk_gated_delta_rule / chunk_kimi_delta_attention compute in fp32 whatever the model's
    dtype): g per head (GDN) or per channel (KDA)."""
    heads = value.shape[2]
    q, k = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    q = q * q.shape[-1] ** -0.5
    s = initial_state.to(value.dtype) if initial_state is not None else \
        value.new_zeros(value.shape[0], heads, k.shape[-1], value.shape[-1])
    outs = []
    for t in range(value.shape[1]):
        decay = g[:, t].exp()
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (value[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outs, 1).to(query.dtype), (s if output_final_state else None)


@contextlib.contextmanager
def float64_delta_rule(arch: str):
    """While the block runs, the family's modeling module calls `sequential_delta_rule` for its chunk kernel (in
    this process: both the reference and the patched twin, whose CP route then runs it on every piece)."""
    import importlib

    module = importlib.import_module(_MODELING[arch])
    name = "chunk_kimi_delta_attention" if hasattr(module, "chunk_kimi_delta_attention") else \
        "torch_chunk_gated_delta_rule"
    saved = getattr(module, name)
    # an entry point as transformers wraps one (a dispatcher whose __wrapped__ is the torch function), so that the
    # kinds' entry-point discovery (longdoc.hf.recurrent.hooks) recognises it and routes it
    setattr(module, name, functools.wraps(sequential_delta_rule)(lambda *a, **k: sequential_delta_rule(*a, **k)))
    try:
        yield
    finally:
        setattr(module, name, saved)


_PACKAGES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "qwen4_exp_text": "qwen4_exp"}
_MODELING = {arch: f"transformers.models.{_PACKAGES.get(arch, arch)}.modeling_{_PACKAGES.get(arch, arch)}"
             for arch in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini",
                          "qwen4_exp_text", "kimi_linear", "bailing_hybrid", "glm5_next")}  # the delta-rule families


def exact_kernels(arch: str):
    """For tests/support/survey.py: float64_delta_rule for a delta-rule family, else nothing to swap."""
    arch = arch if arch in _MODELING else f"{arch}_text"  # the survey names composite types (qwen3_5)
    return float64_delta_rule(arch) if arch in _MODELING else contextlib.nullcontext()
