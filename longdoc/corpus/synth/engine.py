"""The engine: documents of a given token length from a domain's simulator, and their checked QA records.

A document grows section by section from the simulator (`simulator.Simulator`): sections are tokenized
once each and summed; a section that would overshoot is undone (the simulator's state is restored), inert
fillers close the gap, and a full tokenization settles the length. Then up to `qa_per_kind` questions of
each kind are picked from the domain's question maker, and every evidence span is resolved to document
offsets and token depths. The record format is described in `longdoc.corpus.synth`.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import longdoc.corpus.tokens as tk
from longdoc.corpus.synth.legal_case import LegalCaseSimulator
from longdoc.corpus.synth.legal_qa import questions as legal_questions
from longdoc.corpus.synth.medical_chart import PatientChartSimulator
from longdoc.corpus.synth.medical_qa import questions as medical_questions
from longdoc.corpus.synth.questions import QA, Asker
from longdoc.corpus.synth.sections import SECTION_SEPARATOR, Section
from longdoc.corpus.synth.simulator import Domain, Simulator

_DOMAINS: dict[str, Domain] = {
    "legal": Domain("legal", LegalCaseSimulator, legal_questions),
    "medical": Domain("medical", PatientChartSimulator, medical_questions),
}
DOMAINS: tuple[str, ...] = tuple(_DOMAINS)
KINDS = ("lookup", "distractor", "multi_hop", "count", "aggregate", "temporal_order", "interval", "latest")
MIN_TOKENS, MAX_TOKENS = 1024, 1_048_576
_TOLERANCE = 0.01
_FILLER_RATE = 0.12


def synthesize(domain: str, num_docs: int, tokens: int = 32768, seed: int = 0, tokenizer: Any = None,
               qa_per_kind: int = 2) -> list[dict[str, Any]]:
    """`num_docs` documents of about `tokens` tokens each, with up to `qa_per_kind` questions per kind."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}] (designed for 4096-131072), got {tokens}")
    if num_docs < 1 or qa_per_kind < 1:
        raise ValueError(f"num_docs and qa_per_kind must be >= 1, got {num_docs} and {qa_per_kind}")
    tok = tk.get_tokenizer(tokenizer)
    name = tk.tokenizer_name(tok, tokenizer)
    return [_document(domain, i, tokens, seed, tok, name, qa_per_kind) for i in range(num_docs)]


def write_jsonl(records: list[dict[str, Any]], path: str | Path) -> None:
    """One JSON record per line; the folder is created, and the file appears complete or not at all."""
    from longdoc.io import atomic_write

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")

    atomic_write(path, write)


def _document(domain: str, index: int, target: int, seed: int, tok: Any, tok_name: str,
              qa_per_kind: int) -> dict[str, Any]:
    key = f"{domain}:{seed}:{index}"
    spec = _DOMAINS[domain]
    sim = spec.simulator(random.Random(key), target, key)
    mix = random.Random(key + ":mix")
    sections, closing = _grow(sim, tok, target, mix)
    sections, text, offsets = _fit(sim, tok, target, sections, closing)
    qas = _select(spec.questions(sim, Asker(domain, random.Random(key + ":qa")), random.Random(key + ":pick")),
                  qa_per_kind, random.Random(key + ":select"))
    doc_id = f"{domain}-s{seed}-{index:04d}"
    return {
        "id": doc_id, "domain": domain, "seed": seed, "title": sim.title(), "tokenizer": tok_name,
        "num_tokens": len(offsets), "num_chars": len(text),
        "qa": [_qa_record(q, f"{doc_id}-q{j:02d}", text, offsets) for j, q in enumerate(qas)],
        "document": text,
    }


def _measure(tok: Any, sections: list[Section]) -> int:
    todo = [s for s in sections if not s.tokens]
    if todo:
        for s, ids in zip(todo, tk.encode(tok, [s.text for s in todo])["input_ids"]):
            s.tokens = len(ids) + 1  # + the separator
    return sum(s.tokens for s in sections)


def _grow(sim: Simulator, tok: Any, target: int, mix: random.Random) -> tuple[list[Section], list[Section]]:
    """Body sections until the next one would not fit; then inert fillers up to the target."""
    sections = list(sim.opening())
    used = _measure(tok, sections)
    closing = sim.closing()
    c = _measure(tok, closing)
    while True:
        if mix.random() < _FILLER_RATE:
            s = sim.filler()
        else:
            saved = _snapshot(sim)
            s = sim.next(used / max(1, target - c))
            new_closing = sim.closing()
            new_c = _measure(tok, new_closing)
            if used + _measure(tok, [s]) + new_c > target * (1 + _TOLERANCE / 2):
                vars(sim).update(saved)  # undo the section: its facts and state changes never happened
                closing = sim.closing()
                break
            closing, c = new_closing, new_c
        used += _measure(tok, [s])
        sections.append(s)
    c = _measure(tok, closing)
    while True:
        s = sim.filler()
        if used + c + _measure(tok, [s]) / 2 > target:
            break
        used += s.tokens
        sections.append(s)
    return sections, closing


def _snapshot(sim: Simulator) -> dict[str, Any]:
    # Containers are copied so a step can be undone; sections and refs are shared, never mutated.
    return {k: copy.copy(v) if isinstance(v, (list, dict, set, random.Random)) else v for k, v in vars(sim).items()}


def _fit(sim: Simulator, tok: Any, target: int, sections: list[Section], closing: list[Section]):
    """Join, count exactly, then add or drop inert sections; keeps the closest fit seen."""
    best: tuple[int, list[Section]] | None = None
    for _ in range(10):
        text = _join(sections + closing)
        err = len(tk.encode(tok, [text])["input_ids"][0]) - target
        if best is None or abs(err) < abs(best[0]):
            best = (err, list(sections))
        if abs(err) <= _TOLERANCE * target:
            break
        if err < 0:
            for _ in range(50):  # add fillers while each one brings the length closer
                s = sim.filler()
                if _measure(tok, [s]) >= 2 * -err:
                    break
                sections.append(s)
                err += s.tokens
                if err >= 0:
                    break
        else:
            inert = sorted((i for i, s in enumerate(sections) if s.inert), key=lambda i: (-sections[i].tokens, i))
            drop = set()
            for i in inert:
                if sections[i].tokens <= err + _TOLERANCE * target / 2:
                    drop.add(i)
                    err -= sections[i].tokens
                if err <= 0:
                    break
            if not drop:
                break
            sections = [s for i, s in enumerate(sections) if i not in drop]
    err, sections = best
    if abs(err) > 0.05 * target:
        raise RuntimeError(f"could not fit a {sim.domain} document to {target} tokens (got {target + err}); "
                           f"targets of at least 2048 tokens are reliable")
    text = _join(sections + closing)
    offsets = tk.encode(tok, [text], offsets=True)["offset_mapping"][0]
    return sections + closing, text, offsets


def _join(sections: list[Section]) -> str:
    pos, parts = 0, []
    for s in sections:
        s.offset = pos
        parts.append(s.text)
        pos += s.length + len(SECTION_SEPARATOR)
    return SECTION_SEPARATOR.join(parts)


def _select(candidates: list[QA], per_kind: int, rng: random.Random) -> list[QA]:
    """Up to `per_kind` questions of each kind, spread over the kind's question families."""
    out: list[QA] = []
    seen: set[str] = set()
    for kind in KINDS:
        families: dict[str, list[QA]] = {}
        for q in candidates:
            if q.kind == kind and q.question not in seen:
                families.setdefault(q.template.split("/")[0], []).append(q)
        order = sorted(families)
        rng.shuffle(order)
        picked = 0
        while picked < per_kind and any(families.values()):
            for fam in order:
                if families[fam] and picked < per_kind:
                    q = families[fam].pop(rng.randrange(len(families[fam])))
                    if q.question not in seen:
                        seen.add(q.question)
                        out.append(q)
                        picked += 1
    return out


def _qa_record(q: QA, qa_id: str, text: str, offsets: list) -> dict[str, Any]:
    evidence = []
    ends = tk.token_ends(offsets)
    for ref in q.evidence:
        start, end = ref.span()
        depth = round(tk.char_to_token(ends, start) / max(1, len(offsets)), 4)
        evidence.append({"start": start, "end": end, "text": text[start:end], "depth": depth})
    if q.extractive:
        answers = [q.answer, *q.aliases]
        if not any(a.lower() in e["text"].lower() for a in answers for e in evidence):
            raise RuntimeError(f"generator bug: answer {q.answer!r} of {q.template} is not in its evidence")
    return {"id": qa_id, "kind": q.kind, "template": q.template, "question": q.question, "answer": q.answer,
            "aliases": q.aliases, "extractive": q.extractive, "evidence": evidence,
            "depth": evidence[0]["depth"] if evidence else 0.0}
