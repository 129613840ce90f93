"""Typed training recipes: YAML + `key=value` overrides -> checked dataclasses.

    recipe = load_recipe("recipes/cpu-demo.yaml", ["train.steps=5", "cp_size=2", "resume=true"])

Every section is a `@dataclass(kw_only=True, slots=True)` whose `__post_init__` checks its values,
so a bad recipe fails at load time, before a model is loaded or a process group is joined. An
unknown key is an error that lists the valid keys of its section (never silently ignored: a typo
in `checkpoint.evry` would otherwise cost a day of training without checkpoints).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from longdoc import cliargs
from longdoc.parallel.api import STRATEGIES, Strategy
from longdoc.parallel.layout import LAYOUTS, Layout

# Literal field types: a recipe value outside them is refused at load time with the valid choices (_coerce)
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
OnNonfinite = Literal["skip", "abort"]
Task = Literal["qa", "pretrain"]
Decay = Literal["cosine", "linear", "constant"]
MIXED = ("auto", "no", "bf16")
ROPE_TYPES = ("linear", "yarn")
TRACKERS = ("auto", "wandb", "mlflow", "trackio")  # besides TensorBoard (log.tensorboard) and metrics.jsonl
# A token count: an int that also reads k/M suffixes, as the command lines do (`data.seq_len=32k` = 32768)
Tokens = typing.NewType("Tokens", int)


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names the key and the fix."""


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise RecipeError(f"{key}: {msg}")


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

    def __post_init__(self):
        _check(self.r > 0, "lora.r", f"must be positive, got {self.r}")
        _check(self.alpha > 0, "lora.alpha", f"must be positive, got {self.alpha}")
        _check(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _check(bool(self.target_modules), "lora.target_modules", "list at least one module name")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = ""  # documents (jsonl/json/parquet/csv/text folder/hub id), `longdoc data prepare` rows, "random"
    seq_len: Tokens = 4096  # tokens per training sequence (window), before CP sharding
    task: Task = "qa"  # for raw documents: "qa" (document + question -> answer, loss on answers) | "pretrain"
    text_field: str | None = None  # pretrain: the documents' text field; null picks text/document/content
    max_sequences: int | None = None  # use only the first N windows (quick runs)
    questions_per_row: int | None = None  # qa: question/answer turns per row; null = all of a document's that fit
    shuffle: bool = True
    random_size: int = 64  # number of sequences when path == "random" (benchmarks, tests)

    def __post_init__(self):
        _check(bool(self.path), "data.path", "name a jsonl file or folder (make one with `longdoc data synth "
               "--domain legal`), or 'random' for random tokens")
        _check(self.task in typing.get_args(Task), "data.task", f"must be 'qa' or 'pretrain', got {self.task!r}")
        _check(self.seq_len >= 2, "data.seq_len", f"must be at least 2 tokens, got {self.seq_len}")
        _check(self.max_sequences is None or self.max_sequences > 0, "data.max_sequences", "must be positive")
        _check(self.questions_per_row is None or self.questions_per_row > 0, "data.questions_per_row",
               f"must be positive, or null for all that fit, got {self.questions_per_row}")
        _check(self.random_size > 0, "data.random_size", "must be positive")


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
    loss_chunk_tokens: Tokens = 1024  # CE over this many tokens at a time: logits never exist in full
    fsdp: bool = False  # shard parameters/gradients/optimizer with FSDP2 (GPU, NCCL)
    layout: Layout = "zigzag"
    strategy: Strategy = "ring"
    comm_timeout: float = 600.0  # seconds any collective may wait before the run fails
    on_nonfinite: OnNonfinite = "skip"  # a NaN/Inf loss or gradient: "skip" the step (counted) or "abort"
    max_skipped_steps: int = 10  # abort after this many skipped steps in a row
    # CPU (glibc): hand freed tensor memory back to the OS at once instead of keeping 0.5-2 GiB of it per
    # process (a few percent of step time; longdoc.train.metrics.return_freed_memory)
    release_freed_memory: bool = True

    def __post_init__(self):
        _check(self.steps > 0, "train.steps", f"must be positive, got {self.steps}")
        _check(self.batch_size > 0, "train.batch_size", "must be positive")
        _check(self.micro_batch_size > 0, "train.micro_batch_size", "must be positive")
        _check(self.batch_size % self.micro_batch_size == 0, "train.batch_size",
               f"must be a multiple of train.micro_batch_size ({self.micro_batch_size}), got {self.batch_size}")
        _check(self.mixed_precision in MIXED, "train.mixed_precision", f"must be one of {MIXED}")
        _check(self.loss_chunk_tokens > 0, "train.loss_chunk_tokens", "must be positive")
        # repeated from the Literal types for a TrainConfig built in code rather than from a recipe
        _check(self.layout in LAYOUTS, "train.layout", f"must be one of {LAYOUTS}, got {self.layout!r}")
        _check(self.strategy in STRATEGIES, "train.strategy", f"must be one of {STRATEGIES}, got {self.strategy!r}")
        _check(self.comm_timeout > 0, "train.comm_timeout", "must be positive seconds")
        _check(self.on_nonfinite in typing.get_args(OnNonfinite), "train.on_nonfinite", "must be 'skip' or 'abort'")
        _check(self.max_skipped_steps >= 0, "train.max_skipped_steps", "must be >= 0")


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
    cp_size: int = 1  # context-parallel group size; world = dp x cp
    resume: bool = False  # continue from the latest complete checkpoint in OUTPUT/checkpoints
    overwrite: bool = False  # start over in an output_dir that holds another run's checkpoints (deletes them)
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        _check(bool(self.output_dir), "output_dir", "must name a folder for checkpoints, logs and the model")
        _check(self.cp_size >= 1, "cp_size", f"must be >= 1, got {self.cp_size}")
        _check(not (self.resume and self.overwrite), "overwrite", "cannot be combined with resume=true")
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


# ---- building dataclasses from plain data, with the checks a user needs ----

def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return _coerce(value, rest[0], key)
    if origin is Literal:
        _check(value in typing.get_args(tp), key, f"must be one of {typing.get_args(tp)}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # `key=a,b` on the command line
            value = [v for v in value.split(",") if v]
        _check(isinstance(value, (list, tuple)), key, f"must be a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _check(isinstance(value, dict), key, f"must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), key, f"must be a section (mapping of keys), got {value!r}")
        return _build(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        _check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if tp is Tokens:
        if isinstance(value, str):
            try:
                value = cliargs.length(value.replace("_", ""))
            except argparse.ArgumentTypeError:
                _check(False, key, f"must be a token count such as 4096, 4k or 1M (k = 1024), got {value!r}")
        tp = int
    if tp is int:
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                pass
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, (str, int, float)) and not isinstance(value, bool), key,
               f"must be a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), names, n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        raise RecipeError(f"unknown recipe key {prefix}{k}{hint}; valid keys here: "
                          + ", ".join(prefix + n for n in names))
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise RecipeError(f"{prefix or 'recipe'}: {e}") from e


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {dotted}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        if "=" not in item:
            raise RecipeError(f"override {item!r} must look like key=value (dotted keys: train.steps=5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise RecipeError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def recipe_from_dict(data: dict | None, overrides: list[str] | None = None) -> Recipe:
    """A checked Recipe from plain data (e.g. parsed YAML) and `key=value` overrides."""
    tree = dict(data or {})
    if not isinstance(tree, dict):
        raise RecipeError("a recipe must be a YAML mapping of keys to values")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    return _build(Recipe, tree)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (or none: all defaults) and apply `key=value` overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe file {p} does not exist (recipes live in recipes/*.yaml)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"recipe {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {p} must be a YAML mapping of keys to values")
    return recipe_from_dict(data, overrides)
