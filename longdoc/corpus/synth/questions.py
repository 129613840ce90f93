"""Questions over a generated document: the `QA` record and the `Asker` that phrases it.

Families and phrasings are in `data/synth/<domain>/questions.json` (family -> kind, phrasings, whether
the answer is written in its evidence); each domain's `*_qa.questions` decides which facts to ask about.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from longdoc.corpus.synth.sections import Ref
from longdoc.corpus.synth.text import fill, load_data


@dataclass
class QA:
    kind: str
    template: str  # "<question family>/<phrasing index>", for analysis by phrasing
    question: str
    answer: str
    evidence: list[Ref]
    aliases: list[str] = field(default_factory=list)
    extractive: bool = True  # the answer (or an alias) is written inside one of the evidence spans


class Asker:
    """Phrases questions from `data/synth/<domain>/questions.json` (family -> phrasings)."""

    def __init__(self, domain: str, rng: random.Random):
        self.phrasings: dict[str, dict[str, Any]] = load_data(domain, "questions")
        self.rng = rng

    def ask(self, family: str, answer: str, evidence: list[Ref], aliases: list[str] | None = None,
            **slots: Any) -> QA:
        spec = self.phrasings[family]
        i = self.rng.randrange(len(spec["phrasings"]))
        question = fill(spec["phrasings"][i], slots)
        return QA(kind=spec["kind"], template=f"{family}/{i}", question=question[0].upper() + question[1:],
                  answer=answer, evidence=evidence, aliases=aliases or [],
                  extractive=spec.get("extractive", True))


