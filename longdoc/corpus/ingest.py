"""Read and validate documents: jsonl/json, parquet, csv, .txt/.md/.pdf/.docx/.html files and folders of them,
hub dataset ids.

    from longdoc.corpus.ingest import Fields, Skips, read_documents
    skips = Skips()
    docs = list(read_documents(["cases.jsonl"], task="qa", fields=Fields(), skips=skips))

Every problem names where it is (`file:line`, 1-based; `row N` for parquet and hub data) and what
to do about it. By default the first problem raises `CorpusError`; with `skips` given the bad
record (or the bad QA pair) is counted in it instead and reported at the end - never dropped silently.

Normalized records:
    pretrain: {"doc_id", "source", "text"}, plus "pages" ([start, end) per page, PDF) and "sections"
              ([{title, level, start}], DOCX/HTML headings) for documents read from those files
    qa:       {"doc_id", "source", "document", "qas": [{"qa_id", "question", "answer", "kind", "spans"}]}
    chat:     {"doc_id", "source", "messages": [{"role", "content"}]} (longdoc.corpus.chat)
    preference: {"doc_id", "source", "prompt", "chosen", "rejected"}, strings or message lists
              (longdoc.corpus.preference)
`spans` are [start, end) character spans of the answer's evidence in the document: the record's own
evidence when it has some (offsets, or its text found in the document), else the first occurrence of the answer.
Text is found up to case and whitespace: "principal place of business" matches "Principal\nplace of  business"
in hard-wrapped text, and the span is that of the document's own characters.
Reading files, folders (every file read or reported) and hub ids: longdoc.corpus.sources; PDF, DOCX and HTML:
longdoc.corpus.documents.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longdoc.corpus.chat import ChatError, messages_of
from longdoc.corpus.preference import pair_of

# Files, folders and hub ids are read in longdoc.corpus.sources; its names are re-exported here, where callers
# have always imported them from.
from longdoc.corpus.sources import DATA_SUFFIXES as DATA_SUFFIXES
from longdoc.corpus.sources import DOCUMENT_SUFFIXES as DOCUMENT_SUFFIXES
from longdoc.corpus.sources import FOLDER_SUFFIXES as FOLDER_SUFFIXES
from longdoc.corpus.sources import TEXT_SUFFIXES as TEXT_SUFFIXES
from longdoc.corpus.sources import CorpusError as CorpusError
from longdoc.corpus.sources import bad_utf8 as _bad_utf8
from longdoc.corpus.sources import layout as _layout
from longdoc.corpus.sources import looks_like_path as looks_like_path
from longdoc.corpus.sources import raw_records as _raw_records
from longdoc.corpus.sources import utf8_error as _utf8_error

TASKS = ("pretrain", "qa", "chat", "preference")
_TEXT_FIELDS = ("text", "document", "content")


@dataclass
class Skips:
    """What `--skip-bad` left out: counts by reason and every message (each names its file or record)."""

    counts: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)

    def add(self, err: CorpusError) -> None:
        self.counts[err.reason] += 1
        self.messages.append(str(err))

    @property
    def examples(self) -> list[str]:
        return self.messages[:5]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return "skipped nothing"
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items()))
        return f"skipped {self.total} bad item(s): {reasons}; first: " + " | ".join(self.examples)

    def report(self) -> str:
        """The summary, then every skipped item on a line of its own (nothing is left out unnamed)."""
        return "\n".join([self.summary(), *(f"  skipped {m}" for m in self.messages)])


@dataclass(frozen=True)
class Fields:
    """Field (column) names; `text=None` takes the first of text/document/content the data has."""

    text: str | None = None
    document: str = "document"
    question: str = "question"
    answer: str = "answer"
    qa: str = "qa"
    evidence: str = "evidence"
    id: str = "id"


def read_documents(inputs: list[str | Path | dict], task: str = "pretrain", fields: Fields = Fields(),
                   skips: Skips | None = None, split: str = "train", keep: tuple[str, ...] = ()
                   ) -> Iterator[dict[str, Any]]:
    """Validated, normalized records from every input, in order. An input is a path, a hub dataset id,
    or a record (dict) itself, e.g. one made by `longdoc.corpus.synth.synthesize`. Fields named in `keep`
    (e.g. domain, aliases, depth) are copied as they are onto the record and onto each QA pair that has them."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    text_field = fields.text
    for where, raw in _raw_records(inputs, split):
        try:
            if isinstance(raw, CorpusError):
                raise raw
            if _bad_utf8(raw) >= 0:
                raise _utf8_error(where)
            if task == "pretrain":
                text_field = text_field or _pick_text_field(raw, where)
                yield {**_kept(raw, keep), **_layout(raw), "doc_id": _doc_id(raw, fields, where), "source": where,
                       "text": _text(raw, text_field, where, "--text-field")}
            elif task == "chat":  # conversations: longdoc.corpus.chat
                try:
                    messages = messages_of(raw)
                except ChatError as e:
                    raise CorpusError(where, e.problem, e.fix, e.reason) from None
                yield {**_kept(raw, keep), "doc_id": _doc_id(raw, fields, where), "source": where, "messages": messages}
            elif task == "preference":  # prompt / chosen / rejected: longdoc.corpus.preference
                try:
                    pair = pair_of(raw)
                except ChatError as e:
                    raise CorpusError(where, e.problem, e.fix, e.reason) from None
                yield {**_kept(raw, keep), "doc_id": _doc_id(raw, fields, where), "source": where, **pair}
            else:
                yield _qa_record(raw, fields, where, skips, keep)
        except CorpusError as err:
            if skips is None:
                raise
            skips.add(err)


def _kept(raw: dict, keep: tuple[str, ...]) -> dict[str, Any]:
    return {k: raw[k] for k in keep if k in raw}


# ------------------------------------------------------------------------------------- validation
def _pick_text_field(raw: dict, where: str) -> str:
    for name in _TEXT_FIELDS:
        if name in raw:
            return name
    raise CorpusError(where, f"record has none of the fields {list(_TEXT_FIELDS)} (fields: {sorted(raw)[:12]})",
                      "Name the text field with --text-field", reason="missing field")


def _doc_id(raw: dict, fields: Fields, where: str) -> str:
    value = raw.get(fields.id)
    return str(value) if isinstance(value, (str, int)) and str(value) else where


def _text(raw: dict, name: str, where: str, flag: str) -> str:
    if name not in raw or raw[name] is None:
        raise CorpusError(where, f"record has no field {name!r} (fields: {sorted(raw)[:12]})",
                          f"Name the right field with {flag}", reason="missing field")
    value = raw[name]
    if not isinstance(value, str):
        raise CorpusError(where, f"field {name!r} must be a string, got {type(value).__name__}",
                          reason="wrong field type")
    if not value.strip():
        raise CorpusError(where, f"field {name!r} is empty", "Remove the record or use --skip-bad",
                          reason="empty document")
    return value


def _qa_record(raw: dict, fields: Fields, where: str, skips: Skips | None, keep: tuple[str, ...] = ()
               ) -> dict[str, Any]:
    document = _text(raw, fields.document, where, "--document-field")
    doc_id = _doc_id(raw, fields, where)
    if fields.qa in raw and raw[fields.qa] is not None:
        items = raw[fields.qa]
        if not isinstance(items, list):
            raise CorpusError(where, f"field {fields.qa!r} must be a list of question/answer objects",
                              reason="wrong field type")
        pairs = [(f"{where}: {fields.qa}[{i}]", x) for i, x in enumerate(items)]
    elif fields.question in raw or fields.answer in raw:
        pairs = [(where, raw)]
    else:
        raise CorpusError(where, f"record has neither a {fields.qa!r} list nor {fields.question!r}/"
                          f"{fields.answer!r} fields (fields: {sorted(raw)[:12]})",
                          "Name them with --qa-field or --question-field/--answer-field", reason="missing field")
    qas = []
    for i, (at, item) in enumerate(pairs):
        try:
            if not isinstance(item, dict):
                raise CorpusError(at, "expected a question/answer object", reason="not an object")
            question = _text(item, fields.question, at, "--question-field")
            # one line: an answer copied from hard-wrapped text must not train (or score) a line break
            answer = " ".join(_text(item, fields.answer, at, "--answer-field").split())
            qas.append({**_kept(item, keep), "qa_id": str(item.get("id") or f"{doc_id}#{i}"), "question": question,
                        "answer": answer,
                        "kind": str(item.get("kind") or ""),
                        "spans": _spans(item.get(fields.evidence), document, answer, at)})
        except CorpusError as err:
            if skips is None or len(pairs) == 1:
                raise
            skips.add(err)
    if not qas:
        raise CorpusError(where, "no usable question/answer pair", reason="no usable QA")
    return {**_kept(raw, keep), "doc_id": doc_id, "source": where, "document": document, "qas": qas}


def find_text(document: str, text: str, start: int = 0) -> tuple[int, int] | None:
    """[start, end) of the first occurrence of `text` in `document` (from `start`) up to case and whitespace:
    any run of whitespace matches any other ("place of business" finds "place\nof  business"). The span is
    that of the document's own characters; None when it does not occur (or `text` is blank)."""
    words = text.split()
    if not words:
        return None
    m = re.compile(r"\s+".join(map(re.escape, words)), re.IGNORECASE).search(document, start)
    return (m.start(), m.end()) if m else None


def _same_text(a: str, b: str) -> bool:
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def _spans(evidence: Any, document: str, answer: str, where: str) -> list[list[int]]:
    if evidence:
        spans = []
        for j, ev in enumerate(evidence if isinstance(evidence, list) else [evidence]):
            ev = {"text": ev} if isinstance(ev, str) else ev
            start, end = (ev.get("start"), ev.get("end")) if isinstance(ev, dict) else (None, None)
            if start is None and end is None and isinstance(ev, dict) and isinstance(ev.get("text"), str):
                found = find_text(document, ev["text"])  # evidence given as text only
                if found is None:
                    raise CorpusError(where, f"evidence[{j}] text {_shown(ev['text'])!r} not found in the document",
                                      "Fix the text, or give offsets (evidence: [{start, end}])",
                                      reason="evidence not found")
                spans.append(list(found))
                continue
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(document)):
                raise CorpusError(where, f"evidence[{j}] must be {{start, end}} with 0 <= start < end <= "
                                  f"{len(document)} (the document length), or {{text}}, got {ev!r}",
                                  reason="bad evidence span")
            if isinstance(ev.get("text"), str) and not _same_text(document[start:end], ev["text"]):
                raise CorpusError(where, f"evidence[{j}] text does not match document[{start}:{end}] (compared up "
                                  "to case and whitespace)", "Offsets are Python string (code point) offsets",
                                  reason="bad evidence span")
            spans.append([start, end])
        return spans
    found = find_text(document, answer)
    if found is None:
        raise CorpusError(where, f"answer {_shown(answer)!r} not found in the document (compared up to case and "
                          "whitespace)", "Fix the answer, or give evidence spans (evidence: [{start, end}] or "
                          "[{text}])", reason="answer not found")
    return [list(found)]


def _shown(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."
