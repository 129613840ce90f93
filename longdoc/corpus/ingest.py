"""Read and validate documents: jsonl/json, parquet, csv, folders of .txt/.md, hub dataset ids.

    from longdoc.corpus.ingest import Fields, Skips, read_documents
    skips = Skips()
    docs = list(read_documents(["cases.jsonl"], task="qa", fields=Fields(), skips=skips))

Every problem names where it is (`file:line`, 1-based; `row N` for parquet and hub data) and what
to do about it. By default the first problem raises `CorpusError`; with `skips` given the bad
record (or the bad QA pair) is counted in it instead and reported at the end - never dropped silently.

Normalized records:
    pretrain: {"doc_id", "source", "text"}
    qa:       {"doc_id", "source", "document", "qas": [{"qa_id", "question", "answer", "kind", "spans"}]}
`spans` are [start, end) character spans of the answer's evidence in the document: the record's own
evidence when it has some, else the first case-insensitive occurrence of the answer.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASKS = ("pretrain", "qa")
TEXT_SUFFIXES = (".txt", ".md")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")
_TEXT_FIELDS = ("text", "document", "content")


class CorpusError(ValueError):
    """Bad input; the message starts with where it is."""

    def __init__(self, where: str, problem: str, fix: str = "", reason: str = ""):
        super().__init__(f"{where}: {problem}" + (f". {fix}" if fix else ""))
        self.where, self.reason = where, reason or problem


@dataclass
class Skips:
    """Counts what `--skip-bad` left out, by reason, with the first few messages."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, err: CorpusError) -> None:
        self.counts[err.reason] += 1
        if len(self.examples) < 5:
            self.examples.append(str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return "skipped nothing"
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items()))
        return f"skipped {self.total} bad item(s): {reasons}; first: " + " | ".join(self.examples)


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
                yield {**_kept(raw, keep), "doc_id": _doc_id(raw, fields, where), "source": where,
                       "text": _text(raw, text_field, where, "--text-field")}
            else:
                yield _qa_record(raw, fields, where, skips, keep)
        except CorpusError as err:
            if skips is None:
                raise
            skips.add(err)


# ---------------------------------------------------------------------------------------- reading
def _raw_records(inputs: list[str | Path | dict], split: str) -> Iterator[tuple[str, Any]]:
    for i, item in enumerate(inputs, 1):
        if isinstance(item, dict):
            yield f"record {i}", item
            continue
        item = str(item)
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise _empty_folder(path)
            for f in files:
                yield from _text_file(f, path)
        elif path.is_file():
            suffix = path.suffix.lower()
            if suffix in TEXT_SUFFIXES:
                yield from _text_file(path, path.parent)
            elif suffix in (".jsonl", ".ndjson"):
                yield from _jsonl(path)
            elif suffix == ".json":
                yield from _json(path)
            elif suffix == ".csv":
                yield from _csv(path)
            elif suffix == ".parquet":
                yield from _parquet(path)
            else:
                raise CorpusError(str(path), f"unknown file type {suffix!r}",
                                  f"Use one of {TEXT_SUFFIXES + DATA_SUFFIXES} or a folder of text files")
        elif looks_like_path(item):
            raise CorpusError(item, "no such file or folder", "Check the path (hub ids look like 'org/name')")
        else:
            yield from _hub(item, split)


def _empty_folder(path: Path) -> CorpusError:
    """What a folder without text files holds, and the fix that fits it."""
    found = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    bare = sorted(str(p.relative_to(path)) for p in found if not p.suffix)
    data = sorted(str(p.relative_to(path)) for p in found if p.suffix.lower() in DATA_SUFFIXES)
    other = sorted({p.suffix.lower() for p in found if p.suffix and p.suffix.lower() not in DATA_SUFFIXES})
    problem = f"folder has no {'/'.join(TEXT_SUFFIXES)} files"
    if not found:
        return CorpusError(str(path), f"{problem}: it is empty", "Put the documents there as .txt or .md files")
    if bare:
        shown = ", ".join(bare[:3]) + (", ..." if len(bare) > 3 else "")
        return CorpusError(str(path), f"{problem}; it holds {len(bare)} file(s) without an extension ({shown})",
                           f"If they are plain text, give them a .txt extension (for f in {path}/*; do mv \"$f\" "
                           f"\"$f.txt\"; done); a folder is read as text files only")
    if data:
        shown = " ".join(str(path / d) for d in data[:3]) + (" ..." if len(data) > 3 else "")
        return CorpusError(str(path), f"{problem}; it holds data files", f"Pass them directly: {shown}")
    return CorpusError(str(path), f"{problem} (found extensions: {', '.join(other[:10])})",
                       f"Convert them to .txt/.md text, or to one of {DATA_SUFFIXES}")


def _kept(raw: dict, keep: tuple[str, ...]) -> dict[str, Any]:
    return {k: raw[k] for k in keep if k in raw}


def looks_like_path(item: str) -> bool:
    """A local path (rather than a hub dataset id), whether it exists or not."""
    return (item.startswith(("/", ".", "~")) or item.count("/") > 1 or os.sep != "/" and os.sep in item
            or item.lower().endswith(TEXT_SUFFIXES + DATA_SUFFIXES))


def _decode(data: bytes) -> str:
    # Invalid bytes become lone surrogates, so one bad record can be reported (or skipped) by itself.
    return data.decode("utf-8", errors="surrogateescape")


def _bad_utf8(value: Any) -> int:
    """Offset of the first undecodable byte in any string inside `value`, or -1."""
    if isinstance(value, str):
        for i, ch in enumerate(value):
            if "\udc80" <= ch <= "\udcff":
                return i
        return -1
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            if _bad_utf8(v) >= 0:
                return _bad_utf8(v)
    return -1


def _utf8_error(where: str) -> CorpusError:
    return CorpusError(where, "invalid UTF-8", "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                       reason="invalid UTF-8")


def _text_file(path: Path, root: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path.read_bytes())
    bad = _bad_utf8(text)
    if bad >= 0:
        yield f"{path}:{text.count(chr(10), 0, bad) + 1}", _utf8_error(f"{path}:{text.count(chr(10), 0, bad) + 1}")
        return
    yield f"{path}:1", {"id": str(path.relative_to(root)), "text": text}


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            line = _decode(raw)
            if not line.strip():
                continue
            if _bad_utf8(line) >= 0:
                yield where, _utf8_error(where)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, CorpusError(where, f"not valid JSON ({e.msg} at column {e.colno})",
                                         "Each line must be one JSON object", reason="invalid JSON")
                continue
            yield where, rec if isinstance(rec, dict) else CorpusError(
                where, f"expected a JSON object, got {type(rec).__name__}", reason="not an object")


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path.read_bytes())
    dec, pos = json.JSONDecoder(), len(text) - len(text.lstrip())
    line = lambda p: f"{path}:{text.count(chr(10), 0, p) + 1}"  # noqa: E731
    try:
        if not text.startswith("[", pos):
            rec, _ = dec.raw_decode(text, pos)
            yield line(pos), rec if isinstance(rec, dict) else CorpusError(line(pos), "expected an object or an array")
            return
        pos += 1
        while True:
            pos += len(text[pos:]) - len(text[pos:].lstrip(" \t\r\n,"))
            if text.startswith("]", pos):
                return
            start = pos
            rec, pos = dec.raw_decode(text, pos)
            yield line(start), rec if isinstance(rec, dict) else CorpusError(
                line(start), f"expected a JSON object, got {type(rec).__name__}", reason="not an object")
    except json.JSONDecodeError as e:
        raise CorpusError(line(e.pos), f"not valid JSON ({e.msg})", "Fix the file; a JSON file cannot be "
                          "read past a syntax error (jsonl can)", reason="invalid JSON") from None


def _csv(path: Path) -> Iterator[tuple[str, Any]]:
    reader = csv.DictReader(io.StringIO(_decode(path.read_bytes()), newline=""))
    start = 2
    for row in reader:
        where = f"{path}:{start}"
        start = reader.line_num + 1
        yield where, {k: v for k, v in row.items() if k is not None and v is not None}


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        for rec in batch.to_pylist():
            n += 1
            yield f"{path} row {n}", rec


def _hub(name: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub client raises many types; all mean "cannot load this id"
        raise CorpusError(name, f"not a local file or folder, and loading it as a hub dataset failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                          "Check the path, or the dataset id/--split and your network (HF_HUB_OFFLINE)") from None
    for n, rec in enumerate(ds, 1):
        yield f"{name}[{split}] row {n}", rec


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
            answer = _text(item, fields.answer, at, "--answer-field")
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


def _spans(evidence: Any, document: str, answer: str, where: str) -> list[list[int]]:
    if evidence:
        spans = []
        for j, ev in enumerate(evidence if isinstance(evidence, list) else [evidence]):
            start, end = (ev.get("start"), ev.get("end")) if isinstance(ev, dict) else (None, None)
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(document)):
                raise CorpusError(where, f"evidence[{j}] must be {{start, end}} with 0 <= start < end <= "
                                  f"{len(document)} (the document length), got {ev!r}", reason="bad evidence span")
            if isinstance(ev.get("text"), str) and document[start:end] != ev["text"]:
                raise CorpusError(where, f"evidence[{j}] text does not match document[{start}:{end}]",
                                  "Offsets are Python string (code point) offsets", reason="bad evidence span")
            spans.append([start, end])
        return spans
    start = document.lower().find(answer.strip().lower())
    if start < 0:
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        raise CorpusError(where, f"answer {shown!r} not found in the document",
                          "Fix the answer, or give evidence spans (evidence: [{start, end}])",
                          reason="answer not found")
    return [[start, start + len(answer.strip())]]
