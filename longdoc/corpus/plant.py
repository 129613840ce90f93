"""Artificial retrieval facts planted in QA training documents, each with its question.

    longdoc data plant runs/data/legal-4k-train.jsonl --facts 4 --seed 0 --out runs/data/legal-4k-train-planted.jsonl

Fine-tuning on one kind of document teaches its questions, and can cost the model the general skill of finding a
stated fact anywhere in a long context and copying it out: the demo's answers-only fine-tune took needle retrieval
on real text it never saw from 0.60 to 0.20. Training on synthetic key-value retrieval carries that skill to real
haystacks (Xiong et al. 2024, "From Artificial Needles to Real Haystacks"). Here each training document gets
`facts` sentences of the form "<Entity> <label> is listed with the <attribute> <value>." at sentence boundaries
drawn uniformly over its length, and one question per fact ("What is the <attribute> of <entity> <label>?",
kind "retrieval") joins the document's own questions, so every training row teaches both at no extra row.

The vocabulary here (entities, attributes, sentence and question forms) is its own: it shares no template with
the evaluation's needles (longdoc.eval.needle) or the RULER-style suite (longdoc.eval.ruler), so those still
measure transfer, never the training templates. Records are `longdoc data synth` QA records; the evidence offsets
of their own questions move with the inserted text. A pure function of (record, facts, seed).
"""

from __future__ import annotations

import random
import re
from typing import Any

_ENTITIES = ("storage unit", "shipping container", "service vehicle", "document tray", "server rack",
             "warehouse bay", "tool crate", "archive box", "delivery van", "mailbox", "conference room",
             "key fob", "equipment cart", "supply closet", "badge reader", "loading dock")
_ATTRIBUTES = ("inventory tag", "registration code", "asset number", "audit code", "tracking number",
               "serial code", "ledger number", "control number")
_FACT = "{Entity} {label} is listed with the {attribute} {value}."
_QUESTION = "What is the {attribute} of {entity} {label}?"
_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")


def _value(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return str(rng.randint(100_000, 999_999))
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
    return f"{letters}-{rng.randint(1000, 9999)}"


def _boundaries(text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Character offsets where a new sentence may start: never inside the evidence of one of the record's questions
    (an evidence span can hold several sentences)."""
    starts = [0] + [m.end() for m in _BOUNDARY.finditer(text)]
    return [b for b in starts if not any(a < b < e for a, e in spans)]


def plant(record: dict[str, Any], facts: int, seed: int) -> dict[str, Any]:
    """A copy of a QA record with `facts` retrieval facts in its document and their questions appended."""
    if facts < 1:
        raise ValueError(f"facts must be >= 1, got {facts}")
    rng = random.Random(f"plant:{seed}:{record.get('id')}")
    doc = str(record["document"])
    spans = [(e["start"], e.get("end", e["start"])) for q in record.get("qa") or [] for e in q.get("evidence") or []
             if isinstance(e.get("start"), int)]
    starts = _boundaries(doc, spans)
    # distinct (entity, label, attribute) per document: every question has exactly one answer in it
    keys = set()
    while len(keys) < facts:
        keys.add((rng.choice(_ENTITIES), f"{rng.choice('ABCDEFGHKMNPRSTW')}{rng.randint(2, 99)}",
                  rng.choice(_ATTRIBUTES)))
    planted = []
    for entity, label, attribute in sorted(keys):
        at = starts[min(int(rng.random() * len(starts)), len(starts) - 1)]
        value = _value(rng)
        planted.append((at, _FACT.format(Entity=entity.capitalize(), label=label, attribute=attribute,
                                         value=value) + " ", entity, label, attribute, value))
    planted.sort(key=lambda p: p[0])
    out, questions, shift, last = [], [], 0, 0
    moved = [dict(q, evidence=[dict(e) for e in q.get("evidence") or []]) for q in record.get("qa") or []]
    for at, sentence, entity, label, attribute, value in planted:
        out.append(doc[last:at])
        start = at + shift + sentence.index(value)
        questions.append({"kind": "retrieval", "template": "plant/0", "question": _QUESTION.format(
            attribute=attribute, entity=entity, label=label), "answer": value, "aliases": [], "extractive": True,
            "evidence": [{"start": start, "end": start + len(value), "text": value}]})
        out.append(sentence)
        shift += len(sentence)
        last = at
    out.append(doc[last:])
    text = "".join(out)
    for q in moved:  # the record's own evidence moves by every sentence inserted at or before it
        for e in q["evidence"]:
            if isinstance(e.get("start"), int):
                before = sum(len(p[1]) for p in planted if p[0] <= e["start"])
                e["start"] += before
                e["end"] = e.get("end", e["start"]) + before
    for j, q in enumerate(questions):
        q["id"] = f"{record.get('id')}-r{j:02d}"
    for q in moved + questions:
        for e in q["evidence"]:
            if isinstance(e.get("start"), int):
                e["depth"] = round(e["start"] / max(len(text), 1), 4)
        if q["evidence"] and "depth" in q["evidence"][0]:
            q["depth"] = q["evidence"][0]["depth"]
    return {**record, "document": text, "num_chars": len(text), "qa": moved + questions}
