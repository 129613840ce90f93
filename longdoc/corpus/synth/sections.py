"""The pieces a document is made of: `Section`s in reading order, with marked spans that questions cite.

Text that a question relies on is written with `Section.mark(key, text)`, so its character span is known
exactly; a question points at such a span through `Ref(section, key)`, resolved to document offsets once
the engine has joined the sections.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

SECTION_SEPARATOR = "\n"  # sections end with a newline: one blank line between them


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


