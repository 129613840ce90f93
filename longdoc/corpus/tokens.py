"""Tokenizer access for the corpus: the project's loader plus fast counting and char->token maps."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any


def get_tokenizer(tokenizer: Any = None) -> Any:
    """A tokenizer object as is; a name or path through `longdoc.models.load_tokenizer` (None = default)."""
    if tokenizer is None or isinstance(tokenizer, str):
        from longdoc.models import DEFAULT_MODEL, load_tokenizer

        return load_tokenizer(tokenizer or DEFAULT_MODEL)
    return tokenizer


def tokenizer_name(tokenizer: Any, given: Any = None) -> str:
    """A stable label for records: the name given, else the tokenizer's (the default model's cached
    conversion folder is reported as the default model's name, so it does not depend on the machine)."""
    from longdoc.models import DEFAULT_MODEL

    if isinstance(given, str) or given is None:
        return given or DEFAULT_MODEL
    path = Path(str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)))
    if path.name == DEFAULT_MODEL or path.name.startswith(DEFAULT_MODEL + ".Q"):  # GGUF conversion folder
        return DEFAULT_MODEL
    return str(path)


def encode(tokenizer: Any, texts: list[str], offsets: bool = False, special: bool = False) -> dict[str, list]:
    """Token ids (and char offsets) of each text, no length warnings; `special`: add the tokenizer's
    special tokens (e.g. a BOS) as it does by default."""
    return tokenizer(texts, add_special_tokens=special, return_offsets_mapping=offsets,
                     return_attention_mask=False, verbose=False)


def token_ends(offsets: list[tuple[int, int]]) -> list[int]:
    return [end for _, end in offsets]


def char_to_token(ends: list[int], char: int) -> int:
    """Index of the token holding character `char` (or the first one after it), from `token_ends`."""
    return min(bisect.bisect_right(ends, char), len(ends))
