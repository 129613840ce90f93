"""Does `longdoc ask`'s prefill fit in the memory of its ranks at --cp, and which --cp would: decided before any
rank starts or any weights load, from the model's config alone (longdoc.plan.prefill prices one rank).

What one rank may use depends on where the ranks run:
  - spawned local ranks (--cp N, no launcher) on a CPU: this host's available memory, shared by the N ranks. Each
    more rank holds one more copy of the weights and the runtime while the KV cache and the layer's work only split,
    so no larger --cp fits where --cp 1 does not: the line then names the --cp that fits with one rank per node of
    this host's memory (a launcher across nodes);
  - under a launcher on CPUs: the node's available memory, shared by its ranks (world size / nodes);
  - on CUDA: one device's total memory per rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longdoc.plan.hardware import GIB

LAUNCHED_BOUND = 64  # the largest --cp tried where ranks are not bounded by this host's cores
_ACROSS = "launch ranks across nodes (torchrun / accelerate launch, --cp = the world size)"


@dataclass(frozen=True)
class Fit:
    """The prefill's memory per rank at the requested cp, and the smallest cp that fits."""

    cp: int
    need: float  # bytes one rank needs at cp
    share: float  # bytes one rank may use at cp
    where: str  # whose memory that is, in words
    terms: str  # the estimate's larger terms in GiB, in words
    smallest: int | None  # the smallest cp that fits where these ranks run; None: none up to `bound`
    bound: int  # the largest cp tried
    bound_why: str  # why no larger cp is tried
    launched: bool  # the ranks come from a launcher (a larger cp means more processes)
    across: int | None = None  # local CPU ranks: the smallest cp that fits one rank per node of this host's memory
    needs: tuple[float, ...] = ()  # bytes one rank needs at cp 1, 2, ... (up to the largest cp tried)

    @property
    def fits(self) -> bool:
        return self.need <= self.share

    def fix(self) -> str:
        """The --cp that fits, with what a rank then needs; or, when none does here, what would."""
        if self.smallest is not None:
            how = (f"launch {self.smallest} processes with --cp {self.smallest}" if self.launched
                   else f"--cp {self.smallest}")
            return f"use {how} (about {_gib(self.needs[self.smallest - 1])} GiB per rank)"
        if self.across is not None:
            return (f"run on a machine with more memory, or launch {self.across} ranks across nodes with this "
                    f"host's memory each (--cp {self.across}, about {_gib(self.needs[self.across - 1])} GiB per "
                    f"rank; more ranks on this host share its memory and each adds a copy of the weights)")
        return f"find more memory per rank: no --cp up to {self.bound} ({self.bound_why}) fits, or {_ACROSS}"

    def also(self) -> str:
        """The cp part of a line that names a RoPE extension too (longdoc.ask.cli.check_length)."""
        return (f"{self.fix()}; one rank needs about {_gib(self.need)} GiB at --cp {self.cp}, more than the "
                f"{_gib(self.share)} GiB it may use ({self.where})")

    def refusal(self, what: str, shorten: str) -> str:
        """The one line that refuses the run."""
        detail = f" ({self.terms})" if self.terms else ""
        return (f"{what} needs about {_gib(self.need)} GiB per rank at --cp {self.cp}{detail}, more than the "
                f"{_gib(self.share)} GiB one rank may use ({self.where}); {self.fix()}; or {shorten}")


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}" if n >= 10 * GIB else f"{n / GIB:.2f}"


def _memory(cfg: dict[str, Any]) -> tuple[Callable[[int], float], str, int, str, bool, bool]:
    """(bytes one rank may use at cp n, whose memory in words, the largest cp to try and why, launched, gpu)."""
    import torch

    from longdoc.plan import hardware
    from longdoc.runtime.launch import launched_world

    launch = launched_world()
    want = cfg.get("device", "auto")
    gpu = want == "cuda" or (want == "auto" and launch.launched and torch.cuda.is_available())
    if gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but CUDA is not available; use --device cpu")
        total = torch.cuda.get_device_properties(launch.local_rank).total_memory
        return (lambda n: total), f"one CUDA device's {_gib(total)} GiB", LAUNCHED_BOUND, "a sane bound", \
            launch.launched, True
    available = hardware.machine_available_gib() * GIB
    if launch.launched:
        local = max(1, launch.world_size // max(1, launch.nodes))
        return (lambda n: available / local), f"this node's {_gib(available)} GiB available, shared by its " \
            f"{local} ranks", LAUNCHED_BOUND, "a sane bound", True, False
    return (lambda n: available / n), f"this host's {_gib(available)} GiB available, shared by the --cp ranks", \
        os.cpu_count() or 1, "this host's cores", False, False


def check(cfg: dict[str, Any], tokens: int) -> Fit | None:
    """The memory of a prefill of `tokens` at cfg["cp"], and the smallest cp that fits, with the model, dtype,
    device, strategy and layout `cfg` names (the parsed `longdoc ask` arguments). None where the planner cannot read
    the model's shape: the ranks then load it and refuse by name what they cannot run (ALiBi, say)."""
    from longdoc.eval.runner import check_dtype
    from longdoc.plan import strategies
    from longdoc.plan.prefill import prefill_bytes, prefill_terms
    from longdoc.plan.shapes import model_shape

    try:
        shape = model_shape(cfg["model"])
    except (AttributeError, KeyError, TypeError, ValueError):  # a config the planner cannot price (Bloom's)
        return None
    share, where, bound, bound_why, launched, gpu = _memory(cfg)
    strategy, ulysses, cp = cfg.get("strategy", "ring"), cfg.get("ulysses_size"), int(cfg.get("cp", 1))
    kwargs = dict(dtype=check_dtype(cfg.get("dtype", "float32")), strategy=strategy, ulysses=ulysses,
                  layout=cfg.get("layout", "zigzag"), gpu=gpu)
    top = max(bound, cp, LAUNCHED_BOUND)
    needs = tuple(prefill_bytes(shape, tokens, n, **kwargs) for n in range(1, top + 1))

    def valid(n: int) -> bool:  # a cp the strategy can run (Ulysses: a divisor, and enough heads)
        if ulysses is not None and n % ulysses:
            return False
        try:
            strategies.check_heads(strategy, n, ulysses, shape.heads)
        except ValueError:
            return False
        return True

    smallest = next((n for n in range(1, max(bound, cp) + 1) if valid(n) and needs[n - 1] <= share(n)), None)
    across = None
    if smallest is None and not launched and not gpu:  # one rank per node, each with this host's memory
        across = next((n for n in range(1, top + 1) if valid(n) and needs[n - 1] <= share(1)), None)
    big = [t for t in prefill_terms(shape, tokens, cp, **kwargs) if t.bytes >= 0.05 * GIB]
    terms = ", ".join(f"{t.label.split(' (')[0]} {_gib(t.bytes)}" for t in big)
    return Fit(cp=cp, need=needs[cp - 1], share=share(cp), where=where, terms=f"{terms} GiB" if terms else "",
               smallest=smallest, bound=bound, bound_why=bound_why, launched=launched, across=across, needs=needs)
