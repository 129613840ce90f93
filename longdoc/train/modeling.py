"""The model a recipe trains: load, extend RoPE, add LoRA, checkpoint activations, patch for CP, export.

    model, tokenizer = build(recipe.model, recipe.lora, recipe.train, recipe.parallelism, cp, recipe.data.seq_len)
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import warnings
from pathlib import Path

import torch

from longdoc.io import building_dir
from longdoc.train.config import LoraConfig, ModelConfig, ParallelismConfig, RecipeError, TrainConfig

# recipe model.dtype (config.DTYPES) -> the torch dtype the weights are loaded in
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU flags of native bf16 matrix maths (AVX-512 BF16 dot products, Intel AMX tiles). Without them bf16 is
# emulated through fp32 and autocast only adds casts.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """Native-bf16 flags this CPU reports (empty where /proc/cpuinfo is missing: not Linux, or hidden)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]


def resolve_mixed_precision(setting: str, cuda: bool, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """What `train.mixed_precision` means on this machine: "auto" is bf16 on GPUs and on CPUs with native bf16
    (on this project's AVX-512 BF16 EPYC the demo's SmolLM2-135M + LoRA step at 4k tokens, cp=2, takes 1.3x
    less CPU time in bf16 autocast than in fp32: README "CPU precision"), fp32 ("no") on other CPUs, where bf16
    is emulated and only adds casts."""
    if setting != "auto":
        return setting
    return "bf16" if cuda or cpu_bf16_flags(cpuinfo) else "no"


def rope_parameters(config, cfg: ModelConfig) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) of `config` extended as the recipe asks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = dict(getattr(text, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise RecipeError("model.rope_type: this model has per-layer-type RoPE parameters; extend its context "
                          "by editing its config instead")
    original = int(text.max_position_embeddings)
    if params.get("rope_type", "default") not in ("default", None):
        raise RecipeError(f"model.rope_type: the model already uses {params['rope_type']!r} RoPE scaling; "
                          f"stacking another is not supported (unset model.rope_type)")
    new_max = cfg.max_position_embeddings or int(round(original * cfg.rope_factor))
    params.update(rope_type=cfg.rope_type, factor=float(cfg.rope_factor))
    if cfg.rope_type == "yarn":
        params["original_max_position_embeddings"] = original
    return params, new_max


def load_extended(mcfg: ModelConfig):
    """(model, tokenizer) loaded with RoPE extended as `mcfg` asks (model.rope_type / rope_factor); the one
    loader training and evaluation share, so `eval --rope-type` extends exactly as training did."""
    from longdoc import models

    dtype = _TORCH_DTYPES[mcfg.dtype]
    kwargs: dict = {}
    tiny = mcfg.name.startswith(models.TINY_PREFIX)
    if tiny:
        kwargs.update(mcfg.overrides)
    elif mcfg.overrides:
        raise RecipeError("model.overrides applies to tiny:<arch> models only; for a real model, edit a copy of "
                          "its config.json")
    if mcfg.rope_type is not None:
        config = models.load_config(mcfg.name, trust_remote_code=mcfg.trust_remote_code)
        if tiny:
            config = models.tiny_config(mcfg.name[len(models.TINY_PREFIX):], **{**_ids(config), **kwargs})
        params, new_max = rope_parameters(config, mcfg)
        if tiny:
            kwargs.update(rope_parameters=params, max_position_embeddings=new_max)
        else:
            config = copy.deepcopy(config)
            config.rope_parameters = params
            config.max_position_embeddings = new_max
            kwargs["config"] = config
    return models.load(mcfg.name, dtype=dtype, trust_remote_code=mcfg.trust_remote_code, **kwargs)


def context_limit(model) -> int | None:
    """The positions the model was trained for (after any RoPE extension in its config); None for a model
    without position embeddings (state-space / recurrent models have no max_position_embeddings)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit is not None else None


def check_context(tokens: int, limit: int | None, *, what: str, extend: str, shorten: str) -> None:
    """Refuse `tokens` positions past the model's `limit`: RoPE beyond its trained range runs and silently
    returns garbage. `extend` is formatted with the smallest power-of-two factor that fits."""
    if limit is not None and tokens > limit:
        raise RecipeError(f"{what} exceeds the model's context ({limit} tokens); extend it with "
                          f"{extend.format(factor=_factor(tokens, limit))}, or {shorten}")


def build(mcfg: ModelConfig, lcfg: LoraConfig, tcfg: TrainConfig, pcfg: ParallelismConfig, cp, seq_len: int):
    """(model, tokenizer): loaded, RoPE-extended, LoRA-wrapped, checkpointed and CP-patched; train mode."""
    import longdoc

    model, tokenizer = load_extended(mcfg)
    check_context(seq_len, context_limit(model), what=f"data.seq_len={seq_len}",
                  extend="model.rope_type=yarn model.rope_factor={factor}", shorten="shorten data.seq_len")
    model.config.use_cache = False
    if tcfg.router_aux_loss_coef is not None:
        _router_aux(model, tcfg.router_aux_loss_coef, mcfg.name)
    if tcfg.activation_checkpointing:
        # Non-reentrant: works with frozen inputs (LoRA), keyword arguments and the CP autograd Functions.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lcfg.enabled:
        if pcfg.fsdp:
            raise RecipeError("lora.enabled with parallelism.fsdp is not supported: a LoRA run keeps the frozen base "
                              "replicated (DDP); set parallelism.fsdp=false or lora.enabled=false")
        model = _add_lora(model, lcfg)
    if pcfg.offload_checkpoints:  # after LoRA: peft may set the checkpointing up again
        from longdoc.hf.offload import offload_checkpoints

        offload_checkpoints(model)
    if pcfg.tiled_mlp:
        from longdoc.hf.tiled_mlp import tile_mlps

        tile_mlps(model, pcfg.mlp_tile_tokens)
    longdoc.patch(model, cp, strategy=pcfg.strategy)
    model.train()
    return model, tokenizer


def _router_aux(model, coef: float, name: str) -> None:
    """train.router_aux_loss_coef: switch the MoE router auxiliary loss on (coef > 0) or off (0)."""
    from longdoc.hf import router

    if not router.computes_aux(model):
        if coef > 0:
            raise RecipeError(f"train.router_aux_loss_coef={coef}: {name} ({type(model).__name__}) computes no MoE "
                              f"router auxiliary loss; set train.router_aux_loss_coef to null")
        return
    configs = {id(model.config): model.config, id(model.config.get_text_config()): model.config.get_text_config()}
    for c in configs.values():
        c.output_router_logits = coef > 0
        c.router_aux_loss_coef = coef
    model.router_aux_loss_coef = coef  # the causal LM reads its own copy, made at construction


def _ids(config) -> dict:
    return {k: getattr(config, k) for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(config, k, None) is not None}


def _factor(seq_len: int, limit: int) -> float:
    f = 1.0
    while limit * f < seq_len:
        f *= 2
    return f


def _add_lora(model, lcfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in lcfg.target_modules if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(f"lora.target_modules: {missing} not found in {type(model).__name__}; its linear "
                          f"layers are {linear}")
    save = modules_to_save(model, lcfg)
    # A tied lm_head trains with the embeddings (ensure_weight_tying), so the exported model, which ties
    # them again at load time, is the model that was trained.
    peft_cfg = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                              target_modules=list(lcfg.target_modules), task_type="CAUSAL_LM", bias="none",
                              modules_to_save=save or None, ensure_weight_tying=bool(save) and _tied(model))
    with _quiet_deprecations():
        return get_peft_model(model, peft_cfg)


def _tied(model) -> bool:
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and emb is not None and out.weight is emb.weight


def modules_to_save(model, lcfg: LoraConfig) -> list[str]:
    """Module names (suffixes) trained in full beside the adapters: lora.train_embeddings / train_norms /
    modules_to_save, checked against the model (an unknown name lists what there is)."""
    names = {m: n for n, m in model.named_modules()}
    save = list(lcfg.modules_to_save)
    if lcfg.train_embeddings:
        save.append(names[model.get_input_embeddings()].rsplit(".", 1)[-1])
    if lcfg.train_norms:
        norms = sorted({n.rsplit(".", 1)[-1] for m, n in names.items() if type(m).__name__.endswith("Norm")})
        if not norms:
            raise RecipeError(f"lora.train_norms: {type(model).__name__} has no module whose class ends in 'Norm'; "
                              f"name its norm modules in lora.modules_to_save")
        save += norms
    leaves = {n.rsplit(".", 1)[-1] for n in names.values() if n}
    missing = [m for m in lcfg.modules_to_save if m.rsplit(".", 1)[-1] not in leaves]
    if missing:
        raise RecipeError(f"lora.modules_to_save: {missing} not found in {type(model).__name__}; its modules are "
                          f"named {sorted(leaves)[:40]}")
    clash = sorted(set(save) & set(lcfg.target_modules))
    if clash:
        raise RecipeError(f"lora: {clash} are both LoRA target_modules and trained in full (modules_to_save / "
                          f"train_embeddings / train_norms); choose one")
    return list(dict.fromkeys(save))


@contextlib.contextmanager
def _quiet_deprecations():
    # peft still calls transformers' pre-5 `is_gradient_checkpointing`; the warning is not the user's to fix.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def trainable_parameters(model) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def export(model, tokenizer, out: Path, merge_lora: bool, state_dict: dict | None = None) -> Path:
    """Write a `save_pretrained` safetensors model (or LoRA adapter) to `out` atomically (rank 0 only).

    `model` is the unwrapped (peft or transformers) model; it is unpatched here, so the folder loads
    with plain transformers. `state_dict` is the gathered full state dict of an FSDP run.
    """
    from longdoc.hf import unpatch

    out = Path(out)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by an export that was killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    unpatch(model)
    is_peft = hasattr(model, "get_base_model")
    if is_peft and merge_lora:
        with _quiet_deprecations():
            model = model.merge_and_unload()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_disable"):
        base.activation_checkpointing_disable()
    elif getattr(base, "is_gradient_checkpointing", False):
        base.gradient_checkpointing_disable()
    base.config.use_cache = True
    with building_dir(out) as tmp:  # the folder appears complete or not at all; a previous export is replaced
        if state_dict is not None:
            model.save_pretrained(tmp, state_dict=state_dict)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out
