"""The four tables of layer kinds beyond attention, one shape each; every entry is registered by its own module.

    ROUTED            `Routed`: a mixer that runs its own forward with its kernel entry points routed
                      (longdoc.hf.recurrent: the conv gets a halo, the scan state passing)
    FORWARDS          `Forward`: a module whose CP forward longdoc computes itself (its block loop, or its
                      methods shadowed for the call); upstream code it re-implements is checked (longdoc.hf.upstream)
    ATTENTION_TWEAKS  `AttentionTweak`: a module beside a layer's attention, which still runs through the
                      "longdoc_cp" backend (the DSA indexer, Llama 4's temperature tuning)
    REFUSED           `Refused`: a module longdoc has no route for, matched so that the refusal names its feature

A kind module builds its entry and calls `register` at import; longdoc.hf.kinds imports the kind modules once and
reads the four tables as one tuple of `LayerKind`, the view that patch and the KV session use. This module imports
no kind and nothing of longdoc.hf, so any kind module can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

Problem = Callable[[nn.Module, Any], "tuple[str, str] | None"]  # (module, handle) -> (feature, fix) or None


def _no_problem(module: nn.Module, handle) -> tuple[str, str] | None:
    return None


@dataclass(frozen=True)
class LayerKind:
    """The view of any registered entry that patch, the KV session and the call checks read (longdoc.hf.kinds)."""

    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[..., object]  # forward(module, handle, original_forward, *args, **kwargs)
    layer_types: frozenset[str] = field(default_factory=frozenset)
    # config.layer_types entries in which a module of this kind runs beside the layer's attention (Falcon-H1's
    # parallel mixer, Zamba's hybrid layers): covered like layer_types, but their attention still counts
    hybrid_types: frozenset[str] = field(default_factory=frozenset)
    problem: Problem = _no_problem
    replaces_attention: bool = True  # a layer of this kind has no attention call of its own
    packed: bool = False  # packed rows (documents) handled exactly; else refused by name
    decode: bool = False  # KV session prefill / extend handled; else refused by name


@dataclass(frozen=True)
class Routed:
    """Mixers of `classes` that run their own forward with the kernel entry points routed; they handle packed rows
    and decoding (longdoc.hf.recurrent.forward)."""

    name: str
    classes: frozenset[str]
    routes: Callable[[Any], dict]  # routes(call: recurrent.Call) -> {entry point: its CP version}
    routed: frozenset[str]  # every entry point `routes` covers; a mixer calling another one is refused by name
    required: frozenset[str]  # the entry points a forward on sharded tokens must have called
    layer_types: frozenset[str] = field(default_factory=frozenset)
    hybrid_types: frozenset[str] = field(default_factory=frozenset)
    replaces_attention: bool = True


@dataclass(frozen=True)
class Forward:
    """Modules whose CP forward longdoc computes itself: forward(module, handle, original, *args, **kwargs)."""

    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[..., object]
    layer_types: frozenset[str] = field(default_factory=frozenset)
    hybrid_types: frozenset[str] = field(default_factory=frozenset)
    replaces_attention: bool = True
    packed: bool = False
    decode: bool = False


@dataclass(frozen=True)
class AttentionTweak:
    """A module beside a layer's attention, swapped for the call; the attention itself runs through the backend."""

    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[..., object]
    layer_types: frozenset[str] = field(default_factory=frozenset)
    problem: Problem = _no_problem
    packed: bool = True
    decode: bool = True


@dataclass(frozen=True)
class Refused:
    """Modules refused by name: patch reports `problem(module, handle)` (feature, fix) before anything runs."""

    name: str
    matches: Callable[[nn.Module], bool]
    problem: Problem
    # the layer types its modules sit in, so that the refusal names this feature rather than the layer types
    layer_types: frozenset[str] = field(default_factory=frozenset)
    hybrid_types: frozenset[str] = field(default_factory=frozenset)


Entry = Routed | Forward | AttentionTweak | Refused

ROUTED: dict[str, Routed] = {}
FORWARDS: dict[str, Forward] = {}
ATTENTION_TWEAKS: dict[str, AttentionTweak] = {}
REFUSED: dict[str, Refused] = {}
# matching order (first match wins): routed mixers, own forwards, attention-side tweaks, refusals
TABLES: tuple[dict[str, Any], ...] = (ROUTED, FORWARDS, ATTENTION_TWEAKS, REFUSED)
_TABLE = {Routed: ROUTED, Forward: FORWARDS, AttentionTweak: ATTENTION_TWEAKS, Refused: REFUSED}


def register(entry: Entry) -> Entry:
    """Add `entry` to its table; a name is registered once, never overwritten."""
    table = _TABLE.get(type(entry))
    if table is None:
        raise TypeError(f"register takes a Routed, Forward, AttentionTweak or Refused entry, "
                        f"got {type(entry).__name__}")
    if any(entry.name in t for t in TABLES):
        raise ValueError(f"a layer kind named {entry.name!r} is registered already")
    table[entry.name] = entry
    return entry
