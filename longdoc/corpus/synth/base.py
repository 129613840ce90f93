"""Shared machinery of the synthetic generators: data files, sections with marked spans, QA records.

A generator ("sim") produces the document as a list of `Section`s in reading order. Text that a
question relies on is written with `Section.mark(key, text)`, so its character span is known exactly;
a QA record points at such spans through `Ref(section, key)` and the spans are resolved to document
offsets once the sections are joined.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[3] / "data" / "synth"
SECTION_SEPARATOR = "\n"  # sections end with a newline: one blank line between them
DATE_STYLES = ("us", "long", "iso")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")


@functools.cache
def load_data(domain: str, name: str) -> dict[str, Any]:
    """`data/synth/<domain>/<name>.json` (domain "common" for shared vocabularies)."""
    path = DATA_DIR / domain / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"synthetic-data file {path} is missing; the generator needs the repository's data/synth "
            "folder (run from a source checkout or an editable install)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def fill(template: str, ctx: dict[str, Any]) -> str:
    """`template.format_map(ctx)` with an error naming the missing slot and the template."""
    try:
        return template.format_map(ctx)
    except KeyError as e:
        raise KeyError(f"template slot {e} has no value; template: {template!r}") from None


def fmt_date(d: dt.date, style: str) -> str:
    if style == "us":
        return f"{d.month:02d}/{d.day:02d}/{d.year}"
    if style == "long":
        return f"{_MONTHS[d.month - 1]} {d.day}, {d.year}"
    if style == "iso":
        return d.isoformat()
    raise ValueError(f"date style must be one of {DATE_STYLES}, got {style!r}")


def date_aliases(d: dt.date, style: str) -> list[str]:
    """The same date in the other styles, so a correct answer in another format still matches."""
    return [fmt_date(d, other) for other in DATE_STYLES if other != style]


def fmt_money(cents: int) -> str:
    """12345678 -> '$123,456.78'."""
    return f"${cents // 100:,}.{cents % 100:02d}"


def fmt_dollars(dollars: int) -> str:
    """450000 -> '$450,000'."""
    return f"${dollars:,}"


def money_aliases(text: str) -> list[str]:
    """'$450,000' -> ['450,000', '$450,000.00']; '$1,234.00' -> ['1,234.00', '$1,234']."""
    bare = text.lstrip("$")
    other = text[:-3] if text.endswith(".00") else (text if "." in text else text + ".00")
    return [bare] + ([other] if other != text else [])


def fmt_time(minutes: int) -> str:
    """Minutes after midnight -> '7:45 a.m.'."""
    h, m = divmod(minutes, 60)
    suffix = "a.m." if h < 12 else "p.m."
    return f"{(h - 1) % 12 + 1}:{m:02d} {suffix}"


class Section:
    """One piece of the document (a note, a transcript, a letter) with marked spans."""

    def __init__(self, kind: str, date: dt.date | None = None, inert: bool = False):
        self.kind = kind
        self.date = date
        self.inert = inert  # carries no fact any question uses: may be dropped to fit the length
        self.parts: list[str] = []
        self.spans: dict[str, tuple[int, int]] = {}
        self.length = 0
        self.offset = -1  # set when the document is assembled
        self.tokens = 0

    def add(self, *texts: str) -> Section:
        for text in texts:
            self.parts.append(text)
            self.length += len(text)
        return self

    def line(self, text: str = "") -> Section:
        return self.add(text, "\n")

    def mark(self, key: str, text: str, end: str = "") -> Ref:
        """Append `text` and remember its span under `key`; returns a reference to it."""
        if key in self.spans:
            raise ValueError(f"span key {key!r} used twice in one {self.kind} section")
        self.spans[key] = (self.length, self.length + len(text))
        self.add(text, end)
        return Ref(self, key)

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass(frozen=True)
class Ref:
    section: Section
    key: str

    def span(self) -> tuple[int, int]:
        if self.section.offset < 0:
            raise RuntimeError(f"{self.section.kind} section referenced by a question is not in the document")
        start, end = self.section.spans[self.key]
        return self.section.offset + start, self.section.offset + end


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


def number_aliases(n: int) -> list[str]:
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
             "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
             "nineteen", "twenty")
    return [words[n]] if 0 <= n < len(words) else []


def person_name(rng: random.Random, common: dict[str, Any], used: set[str] | None = None,
                sex: str | None = None) -> tuple[str, str, str]:
    """(first, last, sex 'F'|'M'). With `used`, the full name is new and, while the pool lasts, so is the
    surname (so "Mr. Lambert" is unambiguous); `used` is only tested for membership."""
    for attempt in range(10_000):
        s = sex or rng.choice(("F", "M"))
        first = rng.choice(common["first_names_female" if s == "F" else "first_names_male"])
        last = rng.choice(common["last_names"])
        if used is None:
            return first, last, s
        if f"{first} {last}" in used or (last in used and attempt < 50):
            continue
        used.update((f"{first} {last}", last))
        return first, last, s
    raise RuntimeError("ran out of distinct person names; add names to data/synth/common/names.json")
