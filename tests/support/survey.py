"""A survey of every causal-LM type in the installed transformers under CP: exact, refused by name, or wrong.

    python -m tests.support.survey              # every type, CP=2, writes docs/models/survey.json
    python -m tests.support.survey --types llama,mamba2 --cp 3 --out /tmp/s.json

Each type gets a tiny random-init config (the tests' hand-made family configs where they exist, else a generic
shrink of transformers' default config: the text stack's sizes, every MLA dimension together, vision / audio towers
shrunk, and _TYPES for the families whose fields have other names or constraints), a float64 single-process
reference (HF's own forward, eager attention, its own loss, use_cache=False) and a patched twin run on `cp` gloo
ranks from `cp.shard_batch`, called the same way. Statuses:
  exact     loss and every gradient equal the reference (relative 1e-5; real differences are orders larger);
            a gradient numerically zero (below 1e-4 of the model's largest entry in float64, such as OPT's key
            bias: softmax ignores a per-row constant, so both runs hold rounding left from large terms) is
            compared to that floor; a type whose training forward samples at random (it differs from itself
            under another seed, as PhiMoE's sparsemixer) is compared in eval mode and says so; a model that rounds
            to float32 inside whatever its dtype (Gemma 4's norms) is compared, up to the fp32 tolerance 1e-4, to
            its own floor (one process, sdpa instead of eager attention) and says so;
  refused   longdoc refused it by name (UnsupportedFeatureError / CPInputError) before computing anything;
  unbuilt   no text decoder to run (_NOT_TEXT: audio-codebook decoders, speculative-decoding drafters, an image
            captioner whose loss needs an image), or no tiny model could be built (the reason is listed; not a
            longdoc result);
  WRONG     a result that differs from the reference: the one unacceptable outcome;
  CRASH     any other exception (a traceback a user would see).
Every type runs in a fresh process group, so one type's failure cannot desynchronise the next.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

TOL = 1e-5  # relative; the CP core merges softmax blocks in fp32 (docs/design.md), so float64 runs agree to ~1e-7
TOL_FP32 = 1e-4  # where a kernel has no float64 (the tests' fp32 gradient tolerance)
OWN_FLOOR = 4  # above TOL, up to TOL_FP32: exact if within this x the model's own floor (_own_floor)
ZERO_FP64, ZERO_FP32 = 1e-4, 1e-2  # below this x the largest gradient entry, a gradient is numerically 0
LENGTH = 40
MAX_PARAMS = 20_000_000  # longer than the families' windows / chunks / index_topk, not a multiple of 2*cp
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
              initializer_range=0.1, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=64, sliding_window=7, index_topk=8,
              attention_chunk_size=7, tie_word_embeddings=False, rotary_dim=8,  # GPT-J / CodeGen: <= head_dim
              # encoder-decoder families' decoders (BART-style and ProphetNet names)
              decoder_layers=2, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4,
              decoder_ffn_dim=128, encoder_ffn_dim=128, num_decoder_layers=2, num_encoder_layers=1,
              num_decoder_attention_heads=4, num_encoder_attention_heads=4)


def _hand_made(model_type: str, **overrides):
    """The tests' own config for a family, where one exists (hand-checked shapes and patterns), with `overrides`."""
    import importlib

    for module, getter in (("tests.support.hf_families", "family_config"),
                           ("tests.support.hf_hybrids", "hybrid_config"),
                           ("tests.support.hf_hybrids_linear", "hybrid_config"),
                           ("tests.support.hf_dsa", "dsa_config")):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        families = getattr(mod, "FAMILIES", None) or getattr(mod, "HYBRIDS", None) or {}
        if model_type in families and hasattr(mod, getter):
            return getattr(mod, getter)(model_type, **overrides)
    return None


# Multi-head latent attention (DeepSeek-V2/V3 and the families built on them): the generic head_dim=16 breaks the
# rope / nope split, so every MLA dimension is set together (head_dim is the rope part, as DeepSeek-V3's config
# derives it), with as many KV heads as query heads (MLA expands one latent per head) and one expert group.
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
            qk_head_dim=16, num_key_value_heads=4, n_group=1, topk_group=1, first_k_dense_replace=1)
_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              image_size=28, patch_size=14)  # a vision or audio tower the text-only survey never runs, kept small
# model_type -> overrides the generic shrink cannot reach: other field names (GPT-Neo's attention_types, DBRX's
# attn_config), constraints between fields, sub-configs of composite models (a dict under the sub-config's name;
# the text one's merges into the generic text overrides). "_drop": generic fields the config refuses to be given
# (XLNet's max_position_embeddings). Also passed to the tests' hand-made configs.
_ROPE = dict(rope_type="default", rope_theta=10000.0)
_TYPES: dict[str, dict] = {
    "blt": dict(_drop=("vocab_size",), encoder_hash_byte_group_vocab=64, local_attention_window_len=7,  # bytes
                patcher_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                    intermediate_size=64, head_dim=16),
                encoder_config=dict(hidden_size=32, hidden_size_global=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, intermediate_size=64),
                decoder_config=dict(hidden_size=32, hidden_size_global=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, intermediate_size=64, head_dim=16),
                global_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                   intermediate_size=128, head_dim=16)),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
        sliding_attention=dict(_ROPE, mrope_section=[4, 2, 2]), full_attention=None)),  # NoPE global layers
    # DBRX's attention reads attn_config.rope_theta (not a field), clamps with clip_qkv (None crashes); hidden_size
    # is aliased to d_model only after ffn_config copied d_model
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), d_model=64,
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    "prophetnet": dict(_drop=("num_hidden_layers",)),  # set per stack (num_decoder_layers)
    # LSH rotations drawn once (hash_seed), not per forward; 8 x 5 axial positions = LENGTH
    "reformer": dict(is_decoder=True, hash_seed=0, attn_layers=["local", "lsh"], axial_pos_shape=[8, 5],
                     axial_pos_embds_dim=[32, 32], local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4),
    "xlnet": dict(_drop=("max_position_embeddings",), d_head=16),  # it has no maximum length
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention", "indexed_attention"], num_hidden_layers=3,
                       index_layers=[1], kv_source_layers=[0, 1, 1], index_num_heads=2, index_topk=8,
                       index_pool_size=64, index_compression=2, index_num_local_tokens=4, index_num_sink_tokens=1,
                       mlp_only_layers=[0], mlp_only_intermediate_size=128),  # the third layer reads the second's K/V
    "musicgen": dict(decoder=dict(num_codebooks=1)),  # one codebook: input_ids rows are batch rows
    "musicgen_melody": dict(decoder=dict(num_codebooks=1)),
    "gemma3n": dict(text_config=dict(sliding_window=7, layer_types=["sliding_attention", "full_attention"],
                                     num_kv_shared_layers=0, altup_num_inputs=2, laurel_rank=8,
                                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
                                     activation_sparsity_pattern=[0.0, 0.0])),  # as hf_families' gemma3n_text
    "gemma4_text": dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=8),  # per-layer inputs: 134M
    "gemma4": dict(text_config=dict(vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=7),
    "qwen4_exp": dict(text_config=dict(  # its DSA-style indexed layer beside Gated DeltaNet
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2)),
}


# model_type -> why it has no text decoder to survey (checked against its transformers source): listed "unbuilt"
# with this reason, no model built.
_NOT_TEXT = {
    "git": "no text-only forward: GitForCausalLM's loss drops the first image_patch_tokens logits, image or not "
           "(an image-captioning decoder)",
    "musicgen": "no text decoder: an audio-codebook decoder (labels (batch, length, codebooks), its own per-codebook "
                "loss)",
    "musicgen_melody": "no text decoder: an audio-codebook decoder (labels (batch, length, codebooks), its own "
                       "per-codebook loss)",
    "gemma4_assistant": "no standalone decoder: a speculative-decoding drafter that ignores input_ids and reads the "
                        "target model's inputs_embeds and shared KV states",
    "gemma4_unified_assistant": "no standalone decoder: a speculative-decoding drafter that ignores input_ids and "
                                "reads the target model's inputs_embeds and shared KV states",
}
# model_type -> the reference's attention where eager cannot be it: BLT's eager cross-attention turns a patch row with
# no bytes (fully masked) into NaN, its sdpa path into zeros.
_ATTN = {"blt": "sdpa"}
# model_type -> what a model needs after it is built before it runs at all (X-MOD's adapters need a language).
_PREPARE = {"xmod": lambda model: model.set_default_language("en_XX")}


def _has(config, name: str) -> bool:
    """Whether the config has the field `name`; Gemma 4's per-layer fields (head_dim) exist but refuse a read."""
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
        return name in vars(config)


def _derived(cls, name: str) -> bool:
    """Whether `name` is a read-only property of the config class (Falcon's head_dim is hidden_size / heads)."""
    attr = getattr(cls, name, None)
    return isinstance(attr, property) and attr.fset is None


def tiny_config(model_type: str):
    """A tiny config of `model_type`: the tests' own, else transformers' default shrunk (may raise)."""
    from transformers import AutoConfig, PretrainedConfig

    config = _hand_made(model_type, **_TYPES.get(model_type, {}))
    if config is not None:
        return config
    extra = dict(_TYPES.get(model_type, {}))
    default = AutoConfig.for_model(model_type)
    text = default.get_text_config(decoder=True)  # MusicGen: its decoder, not its T5 text encoder
    where = next((k for k, v in vars(default).items() if v is text), None)  # text_config, decoder, ...
    drop = extra.pop("_drop", ())
    overrides = {k: v for k, v in _SMALL.items() if _has(text, k) and not _derived(type(text), k) and k not in drop}
    if getattr(text, "kv_lora_rank", None) is not None:
        overrides.update({k: v for k, v in _MLA.items() if _has(text, k) and getattr(text, k) is not None})
    for key in ("n_group", "topk_group"):  # expert groups: one, as the tiny models have 4 experts
        if _has(text, key) and isinstance(getattr(text, key), int):
            overrides[key] = 1
    towers = {k: {f: v for f, v in _TOWER.items() if _has(sub, f) and not _derived(type(sub), f)}
              for k, sub in vars(default).items() if isinstance(sub, PretrainedConfig) and sub is not text}
    for k in towers:
        towers[k].update(extra.pop(k, {}))
    overrides.update(extra.pop(where, {}) if where else extra)
    types = getattr(text, "layer_types", None)
    if types and "layer_types" not in overrides:  # keep one layer of every type, in order of first appearance
        kinds = list(dict.fromkeys(types))
        overrides["layer_types"] = kinds
        overrides["num_hidden_layers"] = len(kinds)
    mlp = list(getattr(text, "mlp_layer_types", None) or ())
    if set(mlp) == {"dense", "sparse"} and overrides.get("num_hidden_layers") == 2:
        overrides.setdefault("mlp_layer_types", ["dense", "sparse"])  # one dense MLP layer, then one MoE

    def make(over):
        if where is None:
            return AutoConfig.for_model(model_type, **over, **towers)
        return AutoConfig.for_model(model_type, **{where: over}, **towers, **extra)  # composite (multimodal) configs

    try:
        config = make(overrides)
    except (AttributeError, TypeError, ValueError):  # e.g. layer_types derived from other fields
        overrides.pop("layer_types", None)
        overrides.pop("num_hidden_layers", None)
        config = make(overrides)
    text = config.get_text_config(decoder=True)
    for sub in {id(config): config, id(text): text}.values():
        for key, value in vars(sub).items():
            if "drop" in key and isinstance(value, float):  # dropout, pdrop, *_dropout_prob, layerdrop
                setattr(sub, key, 0.0)
    vocab = getattr(text, "vocab_size", 256)
    for sub in {id(config): config, id(text): text}.values():  # Whisper's embedding reads the outer config's pad
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = getattr(sub, key, None)
            if isinstance(v, int) and v >= vocab:
                setattr(sub, key, vocab - 1)
    config_class = _causal_lm_class(model_type).config_class
    if not isinstance(config, config_class):  # MusicGen's causal LM is its decoder alone
        config = next((v for v in vars(config).values() if isinstance(v, config_class)), config)
    return config


def _causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@contextlib.contextmanager
def _towers_without_timm(model_type: str):
    """Gemma 3n's vision tower is a timm model: where timm is not installed, an empty module stands in for it (the
    text-only survey never calls a vision tower; the text stack and the multimodal embedders are the real ones)."""
    import importlib.util

    module = _TIMM_TOWERS.get(model_type)
    if module is None or importlib.util.find_spec("timm") is not None:
        yield
        return
    import importlib

    from transformers import AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    class NoTimm:
        @staticmethod
        def from_config(config, **kwargs):
            if MODEL_MAPPING_NAMES.get(config.model_type) == "TimmWrapperModel":
                return torch.nn.Module()
            return AutoModel.from_config(config, **kwargs)

    mod = importlib.import_module(module)
    saved, mod.AutoModel = mod.AutoModel, NoTimm
    try:
        yield
    finally:
        mod.AutoModel = saved


_TIMM_TOWERS = {"gemma3n": "transformers.models.gemma3n.modeling_gemma3n"}


def _build(model_type: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = tiny_config(model_type)
    new = (AutoModelForCausalLM.from_config if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
           else _causal_lm_class(model_type)._from_config)  # a sub-config (MusicGen's decoder)
    with torch.device("meta"), _towers_without_timm(model_type):  # a default left large: refuse it first
        size = sum(p.numel() for p in new(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {size / 1e6:.0f}M parameters (over {MAX_PARAMS / 1e6:.0f}M)")
    with torch.random.fork_rng(devices=[]), _towers_without_timm(model_type):
        torch.manual_seed(0)
        attn = _ATTN.get(model_type, "eager")
        for extra in ({"attn_implementation": attn, "experts_implementation": "eager"},
                      {"attn_implementation": attn}, {}):
            try:
                model = new(config, **extra)
                break
            except (ValueError, TypeError):
                continue
        else:
            model = new(config)
    if model_type in _PREPARE:
        _PREPARE[model_type](model)
    return model.to(dtype).train()


def _vocab(model) -> int:
    """Token ids the survey may draw: the output vocabulary where it is smaller than the input embedding (Mllama's
    image tokens, CPM-Ant's prompt embeddings are input-only rows; MusicGen has one table per codebook)."""
    emb = model.get_input_embeddings()
    n = emb.num_embeddings if isinstance(emb, torch.nn.Embedding) else model.config.get_text_config().vocab_size
    head = model.get_output_embeddings()
    return min(n, head.out_features) if isinstance(head, torch.nn.Linear) else n


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _exact_kernels(model_type: str):
    """A family module's `exact_kernels(model_type)` context (nothing elsewhere): kernels that compute in fp32
    whatever the model's dtype (the delta rule's chunk kernels) swapped for their float64 definition, in the
    reference and in the CP run alike, so that the float64 pass compares CP with one process and not two
    fp32 roundings of one kernel (whose decay-gate gradients move 1e-4 with the kernel's own chunk size)."""
    import contextlib
    import importlib

    for module in ("tests.support.hf_hybrids_linear",):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, "exact_kernels"):
            return mod.exact_kernels(model_type)
    return contextlib.nullcontext()


def _one(model_type: str, cp) -> tuple[str, str]:
    """(status, detail) of one type on this rank."""
    with _exact_kernels(model_type):
        return _compare(model_type, cp)


def _reference(model, ids, seed: int):
    """(loss, {name: grad}) of one single-process forward and backward, the model's random draws seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _worst(loss, grads: dict, ref_loss, ref_grads: dict, floor: float) -> tuple[float, str]:
    """The largest relative difference (loss, then every gradient) and where. A gradient is relative to its own
    largest entry, floored at `floor` x the model's largest gradient entry: a gradient that is zero in exact
    arithmetic (OPT's key bias: softmax ignores a per-row constant) is rounding noise in both runs, and its
    relative error would be noise over noise."""
    scale = max((g.abs().max().item() for g in ref_grads.values() if g.numel()), default=0.0)
    worst, where = abs(loss - ref_loss).item() / max(abs(ref_loss.item()), 1e-12), "loss"
    for name in sorted(set(grads) | set(ref_grads)):
        g = grads.get(name)
        want = ref_grads.get(name)
        g = torch.zeros_like(want) if g is None else g
        want = torch.zeros_like(g) if want is None else want
        if not g.numel():
            continue
        err = ((g - want).abs().max() / max(want.abs().max().item(), floor * scale, 1e-300)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def _compare(model_type: str, cp) -> tuple[str, str]:
    import copy

    import torch.distributed as dist

    import longdoc
    from longdoc.hf import CPInputError, UnsupportedFeatureError

    if model_type in _NOT_TEXT:
        return "unbuilt", _NOT_TEXT[model_type]
    problem = None
    for dtype in (torch.float64, torch.float32):  # some kernels have no float64
        tol = TOL if dtype == torch.float64 else TOL_FP32
        floor = ZERO_FP64 if dtype == torch.float64 else ZERO_FP32
        try:
            ref = _build(model_type, dtype)
            vocab = _vocab(ref)
        except Exception as e:  # noqa: BLE001 - any failure to build is "unbuilt", reported with its reason
            return "unbuilt", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        twin = copy.deepcopy(ref)
        ids = torch.randint(0, vocab, (2, LENGTH), generator=torch.Generator().manual_seed(1))
        try:
            ref_loss, ref_grads = _reference(ref, ids, seed=0)
            problem = None if ref_loss.isfinite() else f"reference loss is not finite ({ref_loss.item()})"
            break
        except Exception as e:  # noqa: BLE001 - the reference itself does not run: nothing to compare
            problem = f"reference forward failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if problem is not None:
        return "unbuilt", problem
    # A training forward that draws random numbers (PhiMoE's sparsemixer samples its experts; LayerDrop) differs
    # from itself under another seed: no run, sharded or not, can equal it. Such a type is compared in eval mode
    # (no sampling, gradients still flow) and says so; under CP each rank draws for its own tokens, as dropout.
    mode = ""
    again_loss, again_grads = _reference(ref, ids, seed=1)
    if _worst(again_loss, again_grads, ref_loss, ref_grads, floor)[0] > tol:
        ref.eval()
        twin.eval()
        try:
            ref_loss, ref_grads = _reference(ref, ids, seed=0)
        except Exception as e:  # noqa: BLE001 - a random training forward and no eval-mode backward
            return "unbuilt", f"a random training forward, and eval mode fails: {type(e).__name__}: {e}"[:300]
        mode = ", eval mode: its training forward samples at random"
    try:
        model = longdoc.patch(twin, cp)
        out = model(**cp.shard_batch({"input_ids": ids, "labels": ids}), use_cache=False)  # as the reference
        out.loss.backward()
    except (UnsupportedFeatureError, CPInputError) as e:
        return "refused", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001
        return "CRASH", traceback.format_exc(limit=4)[-600:] if not str(e) else f"{type(e).__name__}: {e}"[:600]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    grads = {}
    for name, p in twin.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=cp.group)
        grads[name] = g
    worst, where = _worst(loss, grads, ref_loss, ref_grads, floor)
    if worst <= tol:
        return "exact", f"max relative error {worst:.1e} ({str(dtype).removeprefix('torch.')}{mode})"
    own = _own_floor(ref, ids, ref_loss, ref_grads, floor) if worst <= TOL_FP32 else None
    if own is not None and worst <= OWN_FLOOR * own:
        return "exact", (f"max relative error {worst:.1e} ({str(dtype).removeprefix('torch.')}{mode}), at the model's "
                         f"own floor: one process with sdpa instead of eager attention differs by {own:.1e}")
    return "WRONG", f"relative error {worst:.2e} in {where}{mode}" + (f" (own floor {own:.1e})" if own else "")


def _own_floor(ref, ids, ref_loss, ref_grads, floor: float) -> float | None:
    """How far one process moves from itself when only the attention kernel changes (eager -> sdpa, both exact in
    the model's dtype), or None where it cannot change. A model that rounds to float32 inside whatever its dtype
    (Gemma 4's RMSNorm computes in float32, then its unscaled q.k logits amplify each ulp) turns a last-bit change
    of the attention output into differences far above TOL: any exact reordering, CP's included, meets that floor."""
    import copy

    if ref.config._attn_implementation != "eager":
        return None
    alt = copy.deepcopy(ref)
    try:
        alt.set_attn_implementation("sdpa")
        alt_loss, alt_grads = _reference(alt, ids, seed=0)
    except Exception:  # noqa: BLE001 - no sdpa path: no floor to measure
        return None
    return _worst(alt_loss, alt_grads, ref_loss, ref_grads, floor)[0]


def _rank(rank: int, world: int, types: list[str]) -> dict[str, tuple[str, str]]:
    import torch.distributed as dist
    from transformers.utils import logging

    import longdoc

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for t in types:
        if rank == 0:
            print(f"survey: {t}", file=sys.stderr, flush=True)  # where it was, if a type takes the process down
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        cp = longdoc.ContextParallel(group, timeout=60)
        try:
            results[t] = _one(t, cp)
        except Exception as e:  # noqa: BLE001 - a failure inside the comparison itself
            results[t] = ("CRASH", f"{type(e).__name__}: {e}"[:600])
        statuses = [None] * world
        dist.all_gather_object(statuses, results[t])
        if len({s[0] for s in statuses}) > 1:  # ranks disagree: the worst status wins, with every rank's view
            worst = next(s for s in ("WRONG", "CRASH", "refused", "unbuilt", "exact") if s in {x[0] for x in statuses})
            results[t] = (worst, " | ".join(f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(statuses)))
        dist.destroy_process_group(group)
    return results


def survey(types: list[str] | None = None, cp: int = 2, deadline: float = 7200) -> dict[str, tuple[str, str]]:
    """{model_type: (status, detail)} for the given types (default: every causal-LM type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from longdoc.runtime.spawn import run_local

    types = sorted(types or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return run_local(cp, _rank, types, deadline=deadline, pg_timeout=120)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--out", default="docs/models/survey.json")
    args = parser.parse_args()
    import transformers

    results = survey(args.types.split(",") if args.types else None, args.cp)
    counts: dict[str, int] = {}
    for status, _ in results.values():
        counts[status] = counts.get(status, 0) + 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"transformers": transformers.__version__, "torch": torch.__version__, "cp": args.cp,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "counts": counts, "types": {t: {"status": s, "detail": d} for t, (s, d) in results.items()}}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(out)
    for t, (s, d) in sorted(results.items()):
        if s in ("WRONG", "CRASH"):
            print(f"{s:8s} {t}: {d}")
    print(f"{len(results)} types at cp={args.cp}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
