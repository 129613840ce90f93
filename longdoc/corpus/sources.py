"""Where records come from: data files (jsonl/json/csv/parquet), documents (.txt/.md/.pdf/.docx/.html) and
folders of them, hub dataset ids. Each record comes as (where, raw dict), or (where, CorpusError) for a bad one,
so the caller (longdoc.corpus.ingest.read_documents) raises it or, under --skip-bad, counts it.

    for where, raw in raw_records(["contracts/", "cases.jsonl"], split="train"): ...

A folder is read file by file, sorted: every .txt/.md/.pdf/.docx/.html/.htm file is one document, id = its path
inside the folder; every other file is an error naming it (unsupported types first, so a run without --skip-bad
stops before reading anything). Hidden files (".*") and Office lock files ("~$*") are not documents and are
passed over. Formats: longdoc.corpus.documents.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longdoc.corpus import documents

TEXT_SUFFIXES = (".txt", ".md")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv")
DOCUMENT_SUFFIXES = documents.SUFFIXES  # PDF, DOCX, HTML (longdoc.corpus.documents; the `docs` extra)
FOLDER_SUFFIXES = TEXT_SUFFIXES + DOCUMENT_SUFFIXES  # what a folder is read as: one document per file


class CorpusError(ValueError):
    """Bad input; the message starts with where it is."""

    def __init__(self, where: str, problem: str, fix: str = "", reason: str = ""):
        super().__init__(f"{where}: {problem}" + (f". {fix}" if fix else ""))
        self.where, self.reason = where, reason or problem


def raw_records(inputs: list[str | Path | dict], split: str) -> Iterator[tuple[str, Any]]:
    """(where, raw record or the CorpusError that replaces a bad one) for every input, in order; a problem with
    an input as a whole (no such path, an unknown file type, a folder without documents) raises."""
    for i, item in enumerate(inputs, 1):
        if isinstance(item, dict):
            yield f"record {i}", item
            continue
        item = str(item)
        path = Path(item)
        if path.is_dir():
            yield from _folder(path)
        elif path.is_file():
            suffix = path.suffix.lower()
            if suffix in FOLDER_SUFFIXES:
                yield from _document_file(path, path.parent)
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
                                  f"Supported: {', '.join(FOLDER_SUFFIXES + DATA_SUFFIXES)}, or a folder of "
                                  f"{', '.join(FOLDER_SUFFIXES)} files; convert it to one of them",
                                  reason="unsupported file type")
        elif looks_like_path(item):
            raise CorpusError(item, "no such file or folder", "Check the path (hub ids look like 'org/name')")
        else:
            yield from _hub(item, split)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith((".", "~$")) for part in path.relative_to(root).parts)


def _folder(path: Path) -> Iterator[tuple[str, Any]]:
    """Every file below `path`, sorted: read as a document, or reported as an error naming it (unsupported
    types first, so a run without --skip-bad stops before reading anything)."""
    found = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
    readable = [p for p in found if p.suffix.lower() in FOLDER_SUFFIXES]
    if not readable:
        raise _empty_folder(path)
    others = [p for p in found if p.suffix.lower() not in FOLDER_SUFFIXES]
    for i, f in enumerate(others):
        yield str(f), _unsupported(f, path, others if i == 0 else [])
    for f in readable:
        yield from _document_file(f, path)


def _unsupported(path: Path, root: Path, others: list[Path]) -> CorpusError:
    suffix = path.suffix.lower()
    more = [str(p.relative_to(root)) for p in others[1:]]
    problem = (f"unsupported file type {suffix!r} in a folder" if suffix else "file without an extension in a folder")
    if more:
        problem += f" (and {len(more)} more unsupported: {', '.join(more[:5])}{', ...' if len(more) > 5 else ''})"
    fix = f"A folder is read as documents ({', '.join(FOLDER_SUFFIXES)}); "
    if suffix in DATA_SUFFIXES:
        fix += f"pass data files directly ({path}), "
    elif not suffix:
        fix += "give a plain-text file a .txt extension, "
    else:
        fix += "convert it to one of those, "
    return CorpusError(str(path), problem, fix + "move it out, or use --skip-bad to skip it and report it",
                       reason="unsupported file type")


def _empty_folder(path: Path) -> CorpusError:
    """What a folder without document files holds, and the fix that fits it."""
    found = [p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)]
    bare = sorted(str(p.relative_to(path)) for p in found if not p.suffix)
    data = sorted(str(p.relative_to(path)) for p in found if p.suffix.lower() in DATA_SUFFIXES)
    other = sorted({p.suffix.lower() for p in found if p.suffix and p.suffix.lower() not in DATA_SUFFIXES})
    problem = f"folder has no {'/'.join(FOLDER_SUFFIXES)} files"
    if not found:
        return CorpusError(str(path), f"{problem}: it is empty",
                           f"Put the documents there as {', '.join(FOLDER_SUFFIXES)} files")
    if bare:
        shown = ", ".join(bare[:3]) + (", ..." if len(bare) > 3 else "")
        return CorpusError(str(path), f"{problem}; it holds {len(bare)} file(s) without an extension ({shown})",
                           f"If they are plain text, give them a .txt extension in a copy, leaving the originals "
                           f"where they are (mkdir -p docs-txt && for f in {path}/*; do [ -f \"$f\" ] && cp \"$f\" "
                           f"\"docs-txt/${{f##*/}}.txt\"; done), then pass docs-txt; a folder is read as document "
                           f"files only")
    if data:
        shown = " ".join(str(path / d) for d in data[:3]) + (" ..." if len(data) > 3 else "")
        return CorpusError(str(path), f"{problem}; it holds data files", f"Pass them directly: {shown}")
    return CorpusError(str(path), f"{problem} (found extensions: {', '.join(other[:10])})",
                       f"Convert them to {', '.join(FOLDER_SUFFIXES)} documents, or to one of {DATA_SUFFIXES}")


class _Read(dict):
    """A record read from a PDF/DOCX/HTML file; `layout` (its pages or sections) goes onto the normalized record.
    (An attribute, not a field, so a data file's own "pages" column is never taken for it.)"""

    def __init__(self, record: dict[str, Any], layout: dict[str, Any]):
        super().__init__(record)
        self.layout = layout


def layout(raw: Any) -> dict[str, Any]:
    return raw.layout if isinstance(raw, _Read) else {}


def _document_file(path: Path, root: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() in TEXT_SUFFIXES:
        yield from _text_file(path, root)
        return
    where = str(path)
    try:
        doc = documents.read(path)
    except documents.DocumentError as e:
        yield where, CorpusError(where, e.problem, e.fix, reason=e.reason)
        return
    except OSError as e:
        yield where, CorpusError(where, f"cannot read the file ({e.strerror or e})", reason="unreadable file")
        return
    yield where, _Read({"id": str(path.relative_to(root)), "text": doc.text}, doc.layout())


def looks_like_path(item: str) -> bool:
    """A local path (rather than a hub dataset id), whether it exists or not."""
    return (item.startswith(("/", ".", "~")) or item.count("/") > 1 or os.sep != "/" and os.sep in item
            or item.lower().endswith(FOLDER_SUFFIXES + DATA_SUFFIXES))


def _decode(data: bytes) -> str:
    # Invalid bytes become lone surrogates, so one bad record can be reported (or skipped) by itself.
    return data.decode("utf-8", errors="surrogateescape")


def bad_utf8(value: Any) -> int:
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
            if bad_utf8(v) >= 0:
                return bad_utf8(v)
    return -1


def utf8_error(where: str) -> CorpusError:
    return CorpusError(where, "invalid UTF-8", "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
                       reason="invalid UTF-8")


def _text_file(path: Path, root: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path.read_bytes())
    bad = bad_utf8(text)
    if bad >= 0:
        yield f"{path}:{text.count(chr(10), 0, bad) + 1}", utf8_error(f"{path}:{text.count(chr(10), 0, bad) + 1}")
        return
    yield f"{path}:1", {"id": str(path.relative_to(root)), "text": text}


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            line = _decode(raw)
            if not line.strip():
                continue
            if bad_utf8(line) >= 0:
                yield where, utf8_error(where)
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
