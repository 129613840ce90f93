"""`LayerKind`: one shape for "a layer kind longdoc knows how to shard" (see longdoc.hf.kinds). Its own module,
so that the kind files import it without importing the registry that imports them (no import cycle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn


def _no_problem(module: nn.Module, handle) -> tuple[str, str] | None:
    return None


@dataclass(frozen=True)
class LayerKind:
    """A layer kind other than attention that longdoc computes exactly under CP (see the module docstring)."""

    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[..., object]  # forward(module, handle, original_forward, *args, **kwargs)
    layer_types: frozenset[str] = field(default_factory=frozenset)
    # config.layer_types entries in which a module of this kind runs beside the layer's attention (Falcon-H1's
    # parallel mixer, Zamba's hybrid layers): covered like layer_types, but their attention still counts
    hybrid_types: frozenset[str] = field(default_factory=frozenset)
    problem: Callable[[nn.Module, object], tuple[str, str] | None] = _no_problem
    replaces_attention: bool = True  # a layer of this kind has no attention call of its own
    packed: bool = False  # packed rows (documents) handled exactly; else refused by name
    decode: bool = False  # KV session prefill / extend handled; else refused by name
