"""Building checked recipe dataclasses from plain data (parsed YAML) and `key=value` overrides.

The generic half of longdoc.train.config: type coercion with the errors a user needs (the key, the valid
choices, the fix), unknown keys with a close match, dotted and list-item override paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal

import yaml

from longdoc import cliargs

# A token count: an int that also reads k/M suffixes, as the command lines do (`data.seq_len=32k` = 32768)
Tokens = typing.NewType("Tokens", int)


class RecipeError(ValueError):
    """A recipe key or value is wrong; the message names the key and the fix."""


def check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise RecipeError(f"{key}: {msg}")


def coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return coerce(value, rest[0], key)
        for alt in rest:  # e.g. `resume: bool | Literal["auto"]`: the first alternative that takes the value
            try:
                return coerce(value, alt, key)
            except RecipeError:
                pass
        kinds = [k for a in rest for k in _kinds(a)]
        check(False, key, f"must be {', '.join(kinds[:-1])} or {kinds[-1]}, got {value!r}")
    if origin is Literal:
        check(value in typing.get_args(tp), key, f"must be one of {typing.get_args(tp)}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # `key=a,b` on the command line
            value = [v for v in value.split(",") if v]
        check(isinstance(value, (list, tuple)), key, f"must be a list, got {value!r}")
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        check(isinstance(value, dict), key, f"must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        check(isinstance(value, dict), key, f"must be a section (mapping of keys), got {value!r}")
        return build(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if tp is Tokens:
        if isinstance(value, str):
            try:
                value = cliargs.length(value.replace("_", ""))
            except argparse.ArgumentTypeError:
                check(False, key, f"must be a token count such as 4096, 4k or 1M (k = 1024), got {value!r}")
        tp = int
    if tp is int:
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                pass
        check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key,
               f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if value is False and key.endswith("mixed_precision"):
            return "no"  # YAML 1.1 reads `no` as false: `train.mixed_precision=no` means what it says
        check(isinstance(value, (str, int, float)) and not isinstance(value, bool), key,
               f"must be a string, got {value!r}")
        return str(value)
    return value


def _kinds(tp: Any) -> list[str]:
    """What a recipe value of type `tp` looks like, for errors listing the alternatives of a union."""
    if typing.get_origin(tp) is Literal:
        return [repr(v) for v in typing.get_args(tp)]
    names = {bool: ["true", "false"], Tokens: ["a token count"], int: ["an integer"], float: ["a number"],
             str: ["a string"]}
    return names.get(tp, [getattr(tp, "__name__", str(tp))])


def build(cls: type, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), names, n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        raise RecipeError(f"unknown recipe key {prefix}{k}{hint}; valid keys here: "
                          + ", ".join(prefix + n for n in names))
    kwargs = {k: coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise RecipeError(f"{prefix or 'recipe'}: {e}") from e


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]$")


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree[a][b]... = value for `a.b.c`; `a.mix[1].weight` addresses an item of a list section."""
    parts = dotted.split(".")
    node = tree
    for i, p in enumerate(parts):
        m = _INDEXED.match(p)
        if m:
            items = node.get(m.group(1))
            k = int(m.group(2))
            if not isinstance(items, list) or not k < len(items) or not isinstance(items[k], dict):
                n = len(items) if isinstance(items, list) else 0
                raise RecipeError(f"override {dotted}: {m.group(1)} has {n} item(s), no item [{k}] to set")
            if i == len(parts) - 1:
                raise RecipeError(f"override {dotted}: name a key of the item, e.g. {p}.weight=0.5")
            node = items[k]
            continue
        if i == len(parts) - 1:
            node[p] = value
            return
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"override {dotted}: {p} is a value, not a section")
        node = nxt


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
