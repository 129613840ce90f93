"""What the engine asks of a document domain: the `Simulator` protocol and the `Domain` that pairs it with
its questions.

A simulator keeps the case or chart state and writes the document one section at a time:
    opening()        the first sections (a complaint, a chart summary)
    next(progress)   the next section; `progress` (0..1) is how much of the length is used, so planted facts
                     come due at their scheduled depths
    filler()         an inert section (no fact any question uses), free to add or drop to fit the length
    closing()        the last sections, rendered from the current state with no side effects
    title()          the document's title
The engine undoes a section that would overshoot the length by restoring the simulator's instance
attributes (`vars(sim)`, containers copied), so all its state lives there and sections already written
are never mutated.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from longdoc.corpus.synth.questions import QA, Asker
from longdoc.corpus.synth.sections import Section


@runtime_checkable
class Simulator(Protocol):
    domain: str

    def opening(self) -> list[Section]: ...

    def next(self, progress: float) -> Section: ...

    def filler(self) -> Section: ...

    def closing(self) -> list[Section]: ...

    def title(self) -> str: ...


@dataclass(frozen=True)
class Domain:
    """A domain the engine can generate: how to start its simulator and how to ask about the result."""

    name: str
    # (rng, target tokens, seed key) -> a fresh simulator
    simulator: Callable[[random.Random, int, str], Simulator]
    # (the finished simulator, the asker, an rng) -> every candidate question; typed Any because each
    # domain's question maker reads its own simulator's state
    questions: Callable[[Any, Asker, random.Random], list[QA]]
