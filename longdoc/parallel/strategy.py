"""A context-parallel attention strategy is one object, and the registry that holds them: `register`, `get`, `names`.

A strategy answers everything the package used to switch on its name for: the exact CP attention it runs
(`longdoc.attention`), the bytes one rank sends (`longdoc.parallel.traffic`), the planner's time and buffers for one
layer (`longdoc.plan`), how many ranks split the query heads, and whether it takes a factored group or selected keys.
Its configuration is the group's: ContextParallel(ulysses_size=U) factors the group for usp (creating that is
collective), so a strategy reads the degree from the group (`cp.ulysses_size`) or, for the planner, from the setup.

Each built-in strategy lives in its own module under longdoc/parallel/strategies/ and registers itself there; the
registry imports every module of that folder on the first lookup, so adding a strategy is adding one file. Code
outside the package (a test, a user's plug-in) calls `register` with its own.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from longdoc.parallel import strategies as _builtin
from longdoc.parallel.kernels import Kernel


@dataclass(frozen=True)
class Traffic:
    forward: int  # bytes this rank sends in the forward pass
    backward: int  # ... and in the backward pass

    @property
    def total(self) -> int:
        return self.forward + self.backward


@dataclass(frozen=True)
class LayerComm:
    forward_s: float  # one layer's attention forward, communication included (exposed or hidden)
    backward_s: float  # its backward (the recompute's forward is the caller's)
    forward_bytes: float  # bytes this rank sends in the forward
    backward_bytes: float


class Strategy:
    """How a CP group computes exact attention over a sequence sharded on its ranks.

    A subclass sets `name` (and `order`, where it should be listed among the built-in ones) and implements the
    methods below; the ones with a default fit every strategy that keeps all heads on every rank.
    """

    name: ClassVar[str]
    order: ClassVar[int] = 100  # listing order (names(), the planner's exact ties): ring 0 ... usp 3, then others
    factored: ClassVar[bool] = False  # runs on a group factored as ring_size x ulysses_size (and only on one)
    selects_keys: ClassVar[bool] = True  # takes attention(..., selected=) (sparse indexed attention)

    def heads_split(self, cp_size: int, ulysses_size: int | None) -> int:
        """Ranks the query heads are split over (1: every rank keeps every head). Raises ValueError where the
        group's factoring (`ulysses_size`, None: not factored) does not suit the strategy."""
        return 1

    def check_heads(self, cp_size: int, ulysses_size: int | None, q_heads: int) -> None:
        """Refuse a model with fewer query heads than the ranks that split them (the planner's check; the CP core
        refuses the same from the tensors it is given)."""
        u = self.heads_split(cp_size, ulysses_size)
        if u > q_heads:
            raise ValueError(f"strategy {self.name!r} with {u} Ulysses ranks needs at least {u} query heads, the "
                             f"model has {q_heads}; use a smaller cp / ulysses_size, or ring/allgather")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, causal: bool, scale: float,
               kernel: Kernel, **extra) -> torch.Tensor:
        """This rank's shard of exact attention over the full sequence; differentiable (its autograd Function
        runs the backward). Called by `longdoc.attention` after every rank agreed on the inputs.

        Args:
            q: `[B, H, T_local, D]`, this rank's shard of the queries (cp.shard along dim 2).
            k: `[B, H_kv, T_local, D]`; v the same shape.
            cp: the ContextParallel group (its layout, ring, and for factored strategies its Ulysses groups).
            causal: the pattern's causality; scale: the softmax scale.
            kernel: the block kernel (longdoc.parallel.kernels.select).
            extra: pattern (masks.Pattern), sinks (`[H]` or None), band_kernel, selected (`[B, T_local, n]` or
                None; only where `selects_keys`).

        Returns:
            `[B, H, T_local, D]`, this rank's shard of the output, in q's dtype.
        """
        raise NotImplementedError

    def bytes_sent(self, *, cp_size: int, local_len: int, q_heads: int, kv_heads: int, head_dim: int,
                   itemsize: int, batch: int, ulysses_size: int | None, rank: int, ring_steps: int | None,
                   backend: str) -> Traffic:
        """Bytes CP rank `rank` sends in one attention forward and backward (longdoc.parallel.traffic.bytes_sent)."""
        raise NotImplementedError

    def layer_cost(self, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                   c: int, t_fwd: float, t_bwd: float, bw_span: Callable[[int], float], lat: float) -> LayerComm:
        """The planner's time and bytes of one layer's attention at cp > 1 (longdoc.plan.strategies)."""
        raise NotImplementedError

    def buffers(self, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                c: int) -> tuple[float, str]:
        """Bytes of the communication buffers live in a layer's attention backward, and the formula."""
        raise NotImplementedError

    def kernel_block(self, cp: int, ulysses: int | None, tokens: int) -> int:
        """Query tokens of one attention kernel call at cp > 1: a zigzag chunk (N/2) of this rank's N tokens."""
        return max(1, tokens // 2)

    def factorings(self, cp: int, q_heads: int, pinned: int | None) -> list[int | None]:
        """The ulysses_size values the planner tries at this cp (None: the group is not factored); empty where the
        strategy cannot run there. `pinned`: the one the user asked for, or None."""
        return [None]

    def label(self, cp: int, ulysses: int | None) -> str:
        """Short name of the configuration for the planner's tables."""
        return self.name

    def describe(self, cp: int, ulysses: int | None) -> str:
        """The configuration in words, for the planner's recommendation."""
        return self.name


_REGISTRY: dict[str, Strategy] = {}
_loaded = False


def register(strategy: Strategy) -> Strategy:
    """Add `strategy` under its name; a name already taken is refused (a registered strategy is never replaced)."""
    _load()
    if strategy.name in _REGISTRY:
        raise ValueError(f"a CP strategy named {strategy.name!r} is already registered; pick another name")
    _REGISTRY[strategy.name] = strategy
    return strategy


def names() -> tuple[str, ...]:
    """The registered strategy names, in their listing order."""
    _load()
    order = list(_REGISTRY)
    return tuple(sorted(order, key=lambda n: (_REGISTRY[n].order, order.index(n))))


def get(name: str) -> Strategy:
    """The strategy registered as `name`; an unknown name is refused with the registered ones."""
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, names()))}, got {name!r}")
    return _REGISTRY[name]


def _load() -> None:
    """Import every module of longdoc/parallel/strategies/ once: each registers its strategy."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in pkgutil.iter_modules(_builtin.__path__):
        importlib.import_module(f"{_builtin.__name__}.{module.name}")
