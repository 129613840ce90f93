"""Documents for the evaluations: generated legal / medical text (cached per process) or jsonl files."""

from __future__ import annotations

import json
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


def read_texts(paths: list[str], limit: int | None = None) -> list[str]:
    """The 'document' (or 'text') field of the jsonl lines of `paths` (the first `limit` of each file)."""
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            taken = 0
            for line_no, line in enumerate(f, 1):
                if limit is not None and taken >= limit:
                    break
                if line.strip():
                    taken += 1
                    rec = json.loads(line)
                    text = rec.get("document", rec.get("text")) if isinstance(rec, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{line_no}: needs a 'document' or 'text' string")
                    texts.append(text)
    return texts
