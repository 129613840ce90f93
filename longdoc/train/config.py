"""Typed training recipes: YAML + `key=value` overrides -> checked dataclasses.

    recipe = load_recipe("recipes/cpu-demo.yaml", ["train.steps=5", "parallelism.cp_size=2", "resume=true"])

Every section is a `@dataclass(kw_only=True, slots=True)` whose `__post_init__` checks its values,
so a bad recipe fails at load time, before a model is loaded or a process group is joined. An
unknown key is an error that lists the valid keys of its section (never silently ignored: a typo
in `checkpoint.evry` would otherwise cost a day of training without checkpoints).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from longdoc.parallel import strategy as registry
from longdoc.parallel.layout import LAYOUTS, Layout
from longdoc.train.data_config import DataConfig, MixSource  # noqa: F401 - MixSource re-exported
from longdoc.train.moved_keys import check_moved
from longdoc.train.preference_config import PreferenceConfig
from longdoc.train.recipe_parse import RecipeError, Tokens, parse_overrides  # noqa: F401 - re-exported
from longdoc.train.recipe_parse import build as _build
from longdoc.train.recipe_parse import check as _check
from longdoc.train.recipe_parse import set_dotted as _set_dotted

# Literal field types: a recipe value outside them is refused at load time with the valid choices (recipe_parse.coerce)
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
OnNonfinite = Literal["skip", "abort"]
Decay = Literal["cosine", "linear", "constant"]
MIXED = ("auto", "no", "bf16")
ROPE_TYPES = ("linear", "yarn")
TRACKERS = ("auto", "wandb", "mlflow", "trackio")  # besides TensorBoard (log.tensorboard) and metrics.jsonl


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "SmolLM2-135M-Instruct"  # longdoc.models.load name, local folder, hub id or "tiny:<arch>"
    dtype: Dtype = "float32"  # dtype the weights are kept in (bfloat16 + LoRA: frozen bf16 base, fp32 adapters);
    # bf16 compute over fp32 weights is `train.mixed_precision`
    rope_type: str | None = None  # "linear" | "yarn": extend the context beyond the pretrained length
    rope_factor: float = 1.0
    max_position_embeddings: Tokens | None = None  # new context length; default original * rope_factor
    trust_remote_code: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # config overrides for "tiny:<arch>" models

    def __post_init__(self):
        _check(bool(self.name), "model.name", "must name a model (e.g. SmolLM2-135M-Instruct or tiny:llama)")
        _check(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.rope_type is None or self.rope_type in ROPE_TYPES, "model.rope_type",
               f"must be one of {ROPE_TYPES} or null, got {self.rope_type!r} ('dynamic' NTK is refused: it "
               f"derives frequencies from each rank's largest position, which differs between CP ranks)")
        _check(self.rope_factor >= 1.0, "model.rope_factor", f"must be >= 1, got {self.rope_factor}")
        _check(self.rope_type is not None or self.rope_factor == 1.0, "model.rope_factor",
               "set model.rope_type (linear or yarn) together with a factor > 1")
        _check(self.max_position_embeddings is None or self.max_position_embeddings > 0,
               "model.max_position_embeddings", "must be a positive number of tokens")


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    merge_on_export: bool = True  # export a plain model with the adapter merged into the weights
    # Besides the adapters, train full copies of these (peft modules_to_save; LongLoRA trains embeddings and
    # norms when extending the context). The base weights stay untouched, so the frozen base (KL terms,
    # `model.disable_adapter()`) is still the original model, and checkpoints hold the copies.
    train_embeddings: bool = False  # the input embeddings (and a tied lm_head with them)
    train_norms: bool = False  # every RMSNorm / LayerNorm (modules whose name ends in "norm")
    modules_to_save: list[str] = field(default_factory=list)  # more module names, peft's modules_to_save

    def __post_init__(self):
        _check(self.r > 0, "lora.r", f"must be positive, got {self.r}")
        _check(self.alpha > 0, "lora.alpha", f"must be positive, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(bool(self.target_modules), "lora.target_modules", "list at least one module name")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: Decay = "cosine"  # "cosine" | "linear" | "constant" after warmup
    min_lr_ratio: float = 0.1  # the decayed LR ends at lr * min_lr_ratio
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas",
               f"must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps > 0, "optim.eps", "must be positive")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _check(self.decay in typing.get_args(Decay), "optim.decay",
               f"must be one of {typing.get_args(Decay)}, got {self.decay!r}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(self.max_grad_norm is None or self.max_grad_norm > 0, "optim.max_grad_norm",
               "must be positive, or null to disable clipping")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 10  # optimizer steps
    batch_size: int = 1  # sequences per optimizer step, over all data-parallel replicas
    micro_batch_size: int = 1  # sequences per forward pass per replica; accumulation makes up the rest
    mixed_precision: str = "auto"  # "auto" (bf16 on GPUs and bf16-native CPUs, else none) | "no" | "bf16"
    activation_checkpointing: bool = True
    # CE over this many loss tokens at a time, so logits never exist in full; null (default): sized from the
    # vocabulary so the chunk's fp32 buffers stay under 256 MiB (longdoc.runtime.budgets: 448 tokens at SmolLM2's 49k)
    loss_chunk_tokens: Tokens | None = None
    comm_timeout: float = 600.0  # seconds any collective may wait before the run fails
    # seconds without a heartbeat from another rank before this one stops and names it (a dead node is
    # reported within this, however long a step is; longdoc.train.peers); 0 turns the watch off
    peer_timeout: float = 30.0
    ddp_bucket_cap_mb: float | None = None  # DDP's gradient bucket size in MB (None: DDP's default, 25)
    # check every collective longdoc issues (sequence number, op tag, size) across its group first, and that
    # every trainable parameter gets a gradient in every backward (also LONGDOC_DEBUG_COLLECTIVES=1)
    debug_collectives: bool = False
    on_nonfinite: OnNonfinite = "skip"  # a NaN/Inf loss or gradient: "skip" the step (counted) or "abort"
    max_skipped_steps: int = 10  # abort after this many skipped steps in a row
    # CPU (glibc): hand freed tensor memory back to the OS at once instead of keeping 0.5-2 GiB of it per
    # process (a few percent of step time; longdoc.train.metrics.return_freed_memory)
    release_freed_memory: bool = True
    # MoE models: the router's auxiliary load-balancing loss, from the whole sequence's statistics under CP.
    # null keeps the model's own config (output_router_logits / router_aux_loss_coef); a number >= 0 sets the
    # coefficient (0 switches the auxiliary loss off). Logged as aux_loss.
    router_aux_loss_coef: float | None = None

    def __post_init__(self):
        _check(self.steps > 0, "train.steps", f"must be positive, got {self.steps}")
        _check(self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0, "train.router_aux_loss_coef",
               f"must be null (the model's own) or a number >= 0, got {self.router_aux_loss_coef}")
        _check(self.batch_size > 0, "train.batch_size", "must be positive")
        _check(self.micro_batch_size > 0, "train.micro_batch_size", "must be positive")
        _check(self.batch_size % self.micro_batch_size == 0, "train.batch_size",
               f"must be a multiple of train.micro_batch_size ({self.micro_batch_size}), got {self.batch_size}")
        _check(self.mixed_precision in MIXED, "train.mixed_precision", f"must be one of {MIXED}")
        _check(self.loss_chunk_tokens is None or self.loss_chunk_tokens > 0, "train.loss_chunk_tokens",
               "must be positive, or null to size it from the vocabulary")
        _check(self.comm_timeout > 0, "train.comm_timeout", "must be positive seconds")
        _check(self.peer_timeout >= 0, "train.peer_timeout", "must be >= 0 seconds (0 turns the lost-peer watch off)")
        _check(self.ddp_bucket_cap_mb is None or self.ddp_bucket_cap_mb > 0, "train.ddp_bucket_cap_mb",
               "must be positive MB (or null for DDP's default)")
        _check(self.on_nonfinite in typing.get_args(OnNonfinite), "train.on_nonfinite", "must be 'skip' or 'abort'")
        _check(self.max_skipped_steps >= 0, "train.max_skipped_steps", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """How one sequence is split over the ranks and what each rank keeps of the model: world = dp x cp_size."""

    cp_size: int = 1  # context-parallel group size; world = dp x cp
    strategy: str = "ring"  # a registered CP strategy (longdoc.parallel.strategy.names())
    # strategy usp only: ranks per Ulysses group (a divisor of cp_size); cp = ring_size x ulysses_size
    ulysses_size: int | None = None
    layout: Layout = "zigzag"
    fsdp: bool = False  # shard parameters/gradients/optimizer with FSDP2 over dp x cp (GPU: NCCL; CPU: gloo)
    # keep each checkpointed layer's input in (pinned, on GPU) host memory, fetched back one layer ahead of its
    # recompute on a side stream (longdoc.hf.offload); needs train.activation_checkpointing
    offload_checkpoints: bool = False
    # run every MLP over tiles of mlp_tile_tokens local tokens with recompute, so no (tokens x intermediate) tensor
    # of the full local length exists (longdoc.hf.tiled_mlp); null tile: the model's hidden size (ALST's choice)
    tiled_mlp: bool = False
    mlp_tile_tokens: Tokens | None = None

    def __post_init__(self):
        _check(self.cp_size >= 1, "parallelism.cp_size", f"must be >= 1, got {self.cp_size}")
        # repeated from the Literal types for a config built in code rather than from a recipe
        _check(self.layout in LAYOUTS, "parallelism.layout", f"must be one of {LAYOUTS}, got {self.layout!r}")
        _check(self.strategy in registry.names(), "parallelism.strategy",
               f"must be one of {registry.names()}, got {self.strategy!r}")
        divisors = [d for d in range(1, self.cp_size + 1) if self.cp_size % d == 0]
        _check(registry.get(self.strategy).factored == (self.ulysses_size is not None), "parallelism.ulysses_size",
               f"goes with parallelism.strategy=usp, which factors cp_size={self.cp_size} as ring x Ulysses: set "
               f"both (ulysses_size one of {divisors}) or neither; got {self.ulysses_size} with {self.strategy!r}")
        _check(self.ulysses_size is None or self.ulysses_size in divisors, "parallelism.ulysses_size",
               f"must be a divisor of cp_size={self.cp_size} ({divisors}), got {self.ulysses_size!r}")
        _check(self.mlp_tile_tokens is None or self.mlp_tile_tokens > 0, "parallelism.mlp_tile_tokens",
               "must be positive, or null for the model's hidden size")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0  # save every N optimizer steps (0: only at the end)
    keep: int = 2  # complete checkpoints kept; older ones are deleted
    at_end: bool = True
    export: bool = True  # write a `save_pretrained` safetensors model to OUTPUT/final at the end

    def __post_init__(self):
        _check(self.every >= 0, "checkpoint.every", "must be >= 0 (0 saves only at the end)")
        _check(self.keep >= 1, "checkpoint.keep", "must keep at least 1 checkpoint")


@dataclass(kw_only=True, slots=True)
class LogConfig:
    every: int = 1  # log metrics every N optimizer steps
    tensorboard: bool = True
    progress: bool = True  # rank-0 tqdm bar
    plot: bool = True  # loss-curve PNG at the end
    # more Accelerate trackers: "auto" = every one of wandb, mlflow, trackio that is installed; offline by default
    trackers: list[str] = field(default_factory=list)

    def __post_init__(self):
        _check(self.every >= 1, "log.every", "must be >= 1")
        bad = [t for t in self.trackers if t not in TRACKERS]
        _check(not bad, "log.trackers", f"unknown tracker(s) {bad}; choose from {TRACKERS} (TensorBoard is "
               f"log.tensorboard)")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0  # validation loss on held-out rows every N optimizer steps (0: no validation)
    path: str = ""  # held-out rows, in any format data.path takes; empty: see holdout
    holdout: int = 0  # with no eval.path: hold out the LAST N training rows (never trained on)
    max_sequences: int | None = None  # validate on the first N held-out rows only
    at_end: bool = True  # also after the last step
    patience: int = 0  # early stopping: stop after N validations without improvement (0: never stop early)
    min_delta: float = 0.0  # an improvement is a validation loss below best - min_delta

    def __post_init__(self):
        _check(self.every >= 0, "eval.every", "must be >= 0 (0 turns validation off)")
        _check(self.holdout >= 0, "eval.holdout", "must be >= 0")
        _check(not (self.path and self.holdout), "eval.holdout",
               "cannot be combined with eval.path: held-out rows come from one or the other")
        _check(self.every == 0 or bool(self.path) or self.holdout > 0, "eval.every",
               "needs held-out rows: set eval.path (a file or folder like data.path) or eval.holdout=N")
        _check(self.max_sequences is None or self.max_sequences > 0, "eval.max_sequences", "must be positive")
        _check(self.patience >= 0, "eval.patience", "must be >= 0 (0: never stop early)")
        _check(self.patience == 0 or self.every > 0, "eval.patience", "early stopping needs eval.every > 0")
        _check(self.min_delta >= 0, "eval.min_delta", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class Recipe:
    output_dir: str = "runs/default"
    # true: continue from the latest complete checkpoint in OUTPUT/checkpoints, refused when there is none (a typo in
    # output_dir must not restart a long run); "auto": continue if there is one, else start at step 0; false: start
    resume: bool | Literal["auto"] = False
    overwrite: bool = False  # start over in an output_dir that holds another run's checkpoints (deletes them)
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)  # data.task: preference only

    def __post_init__(self):
        _check(bool(self.output_dir), "output_dir", "must name a folder for checkpoints, logs and the model")
        _check(self.train.activation_checkpointing or not self.parallelism.offload_checkpoints,
               "parallelism.offload_checkpoints",
               "offloads the layer checkpoints, so it needs train.activation_checkpointing=true")
        _check(isinstance(self.resume, bool) or self.resume == "auto", "resume",
               f"must be true, false or 'auto', got {self.resume!r}")
        _check(not (self.resume and self.overwrite), "overwrite",
               f"cannot be combined with resume={'auto' if self.resume == 'auto' else 'true'}")
        _check(self.lora.enabled or not any(m.kl_weight for m in self.data.mix), "data.mix.kl_weight",
               "needs lora.enabled: the frozen base is the model with its adapters disabled (no second copy of the "
               "weights); for full fine-tuning use a rehearsal or text source instead")
        _check(not (self.data.mix and self.eval.holdout), "eval.holdout",
               "is not supported with data.mix (which source would it hold out?); set eval.path to held-out rows")
        _check_preference(self)
        _check(self.optim.warmup_steps <= self.train.steps, "optim.warmup_steps",
               f"({self.optim.warmup_steps}) exceeds train.steps ({self.train.steps})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value (for trackers and for printing the effective recipe)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, d: dict):
            for k, v in d.items():
                if isinstance(v, dict) and k != "overrides":
                    walk(f"{prefix}{k}.", v)
                else:
                    out[prefix + k] = v

        walk("", self.to_dict())
        return out


def _check_preference(r: Recipe) -> None:
    if r.data.task != "preference":
        return
    _check(r.lora.enabled or r.preference.loss != "sigmoid", "preference.loss",
           "sigmoid DPO needs lora.enabled: its reference is the model with the LoRA adapters disabled, and full "
           "fine-tuning would need a second, frozen copy of the weights, which longdoc does not keep; enable LoRA "
           "or use the reference-free preference.loss=simpo")
    _check(not r.data.mix, "data.mix", "cannot hold preference rows: train data.task: preference from data.path")
    _check(not (r.eval.every or r.eval.path or r.eval.holdout), "eval.every",
           "validation computes the SFT loss, not the preference loss; set eval.every=0 and no eval.path / "
           "eval.holdout for data.task: preference")


def recipe_from_dict(data: dict | None, overrides: list[str] | None = None) -> Recipe:
    """A checked Recipe from plain data (e.g. parsed YAML) and `key=value` overrides."""
    tree = copy.deepcopy(dict(data or {}))  # overrides edit nested sections and list items in place
    if not isinstance(tree, dict):
        raise RecipeError("a recipe must be a YAML mapping of keys to values")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    check_moved(tree)
    return _build(Recipe, tree)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or none: all defaults) and apply `key=value` overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe file {p} does not exist (`longdoc recipes` lists the shipped ones, --copy DIR)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"recipe {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {p} must be a YAML mapping of keys to values")
    return recipe_from_dict(data, overrides)
