"""Documents for the evaluations: generated legal / medical text (cached per process) or jsonl files."""

from __future__ import annotations

import itertools
from typing import Any

_CACHE: dict[tuple, list[str]] = {}


def synth_documents(domain: str, tokens: int, count: int, seed: int, tokenizer: Any) -> list[str]:
    """`count` generated documents of about `tokens` tokens (deterministic; cached, so a compare run that
    evaluates two models with one tokenizer generates them once)."""
    from longdoc.corpus.synth import MIN_TOKENS, synthesize

    target = max(MIN_TOKENS, tokens)
    key = (domain, target, count, seed, getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    if key not in _CACHE:
        records = synthesize(domain, num_docs=count, tokens=target, seed=seed, tokenizer=tokenizer)
        _CACHE[key] = [r["document"] for r in records]
    return list(_CACHE[key])


def read_texts(paths: list[str], limit: int | None = None, skips: Any = None) -> list[str]:
    """The document texts of `paths` (the first `limit` of each input), read by the reader `longdoc data
    prepare` uses: jsonl/json/parquet/csv with a text/document/content field, .txt/.md/.pdf/.docx/.html files
    and folders of them, hub ids. With `skips` (a `longdoc.corpus.ingest.Skips`: --skip-bad) an unreadable file
    or bad record is left out and counted there instead of raising."""
    from longdoc.corpus.ingest import read_documents

    texts = []
    for path in paths:
        docs = read_documents([path], task="pretrain", skips=skips)
        texts += [d["text"] for d in (docs if limit is None else itertools.islice(docs, limit))]
    return texts


def check_inputs(paths: list[str], flag: str, limit: int | None = 1, task: str = "pretrain", skips: Any = None
                 ) -> None:
    """Fail fast, before ranks start: a missing path by name, a bad record with its file:line and the fix.
    With `skips` (a `longdoc.corpus.ingest.Skips`: --skip-bad) bad records are passed over, and an input with
    no usable record is the error."""
    from pathlib import Path

    from longdoc.corpus.ingest import looks_like_path, read_documents

    for path in paths:
        if not Path(path).exists() and looks_like_path(str(path)):
            raise FileNotFoundError(f"{flag} {path} does not exist (give a jsonl/json/parquet/csv file, a document "
                                    f"(.txt/.md/.pdf/.docx/.html) or a folder of them, or a hub dataset id)")
        read = sum(1 for _ in itertools.islice(read_documents([path], task=task, skips=skips), limit))
        if skips is not None and not read:
            raise ValueError(f"{flag} {path}: no usable record ({skips.summary()})")


def skipped(skips: Any, flag: str) -> dict[str, Any]:
    """What --skip-bad left out of the input `flag` names, as results.json keeps it (every item named)."""
    return {"flag": flag, "total": skips.total, "by_reason": dict(skips.counts), "summary": skips.summary(),
            "messages": list(skips.messages)}


def skipped_lines(results: dict[str, Any]) -> list[str]:
    """Every item --skip-bad left out of a run's input, one line each (none when nothing was skipped)."""
    s = results.get("skipped")
    if not isinstance(s, dict):  # chat-loss and position-loss use "skipped" for what did not fit --length
        return []
    return [f"{s.get('flag', 'input')}: skipped {m}" for m in s.get("messages", [])]
