"""Artificial retrieval facts planted in QA training documents, each with its question.

    longdoc data plant runs/data/legal-4k-train.jsonl --facts 4 --seed 0 --out runs/data/legal-4k-train-planted.jsonl

Fine-tuning on one kind of document teaches its questions, and can cost the model the general skill of finding a
stated fact anywhere in a long context and copying it out: the demo's answers-only fine-tune took needle retrieval
on real text it never saw from 0.60 to 0.20. Training on synthetic key-value retrieval carries that skill to real
haystacks (Xiong et al. 2024, "From Artificial Needles to Real Haystacks"). Here each training document gets
`facts` sentences stating one attribute of one labelled thing ("For server rack K17, the radio channel is
amber-falcon.") at sentence boundaries drawn uniformly over its length, and one question per fact ("Which radio
channel does server rack K17 have?", kind "retrieval") joins the document's own questions, so every training row
teaches both at no extra row. The attributes (38 kinds), sentence forms (5), question forms (4) and values
(numbers, letter-number codes, two-word names) vary, so that what carries over is reading the question's key and
copying the value stated beside it, not one shape of question or answer: with a narrow vocabulary (8 code-like
attributes, numeric values, one form each) a fine-tune still answered needles whose attribute it had never seen
with the document's title (docs/outcome/experiments.md).

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
             "key fob", "equipment cart", "supply closet", "badge reader", "loading dock", "field laptop",
             "print station", "boiler room", "generator", "drone", "bicycle", "forklift", "freezer", "printer",
             "greenhouse", "workshop", "trailer", "router", "camera", "project", "team", "account", "workstation")
_ATTRIBUTES = ("inventory tag", "registration code", "asset number", "audit code", "tracking number",
               "serial code", "ledger number", "control number", "door code", "alarm code", "passphrase", "PIN",
               "radio channel", "extension", "shelf label", "batch code", "lot number", "call sign", "password",
               "reference word", "colour code", "seat number", "gate number", "licence plate", "cipher word",
               "routing code", "backup key", "codename", "model name", "nickname", "room number", "bin number",
               "unit code", "login name", "keyword", "frequency", "short name", "motto")
_FACTS = ("{Entity} {label} is listed with the {attribute} {value}.",
          "The {attribute} of {entity} {label} is {value}.",
          "For {entity} {label}, the {attribute} is {value}.",
          "{Entity} {label} uses the {attribute} {value}.",
          "Note that the {attribute} for {entity} {label} was set to {value}.")
_QUESTIONS = ("What is the {attribute} of {entity} {label}?",
              "Which {attribute} does {entity} {label} have?",
              "Give the {attribute} for {entity} {label}.",
              "What {attribute} was given for {entity} {label}?")
_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
          "lantern", "marble", "nimbus", "orchid", "pepper", "quartz", "raven", "saffron", "tundra", "umber",
          "violet", "willow", "yonder", "zephyr", "copper", "meadow", "thistle", "comet", "walnut")
_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")


def _value(rng: random.Random) -> str:
    """A value no document holds by chance: a number, a letter-number code, or a two-word name (the model learns to
    copy whatever the fact says, not one shape of answer)."""
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randint(1000, 9_999_999))
    if kind < 0.7:
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
        return f"{letters}-{rng.randint(1000, 9999)}"
    first, second = rng.sample(_WORDS, 2)
    return f"{first}-{second}" if rng.random() < 0.5 else f"{first.capitalize()} {second.capitalize()}"


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
    planted, values = [], set()
    for entity, label, attribute in sorted(keys):
        at = starts[min(int(rng.random() * len(starts)), len(starts) - 1)]
        value = _value(rng)
        while value in values or value in doc:
            value = _value(rng)
        values.add(value)
        fact = rng.choice(_FACTS).format(Entity=entity.capitalize(), entity=entity, label=label,
                                         attribute=attribute, value=value)
        planted.append((at, fact + " ", entity, label, attribute, value, rng.choice(_QUESTIONS)))
    planted.sort(key=lambda p: p[0])
    out, questions, shift, last = [], [], 0, 0
    moved = [dict(q, evidence=[dict(e) for e in q.get("evidence") or []]) for q in record.get("qa") or []]
    for at, sentence, entity, label, attribute, value, form in planted:
        out.append(doc[last:at])
        start = at + shift + sentence.rindex(value)
        questions.append({"kind": "retrieval", "template": "plant/0", "question": form.format(
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


def windows(texts: list[tuple[str, str]], tokens: int, per_document: int, tokenizer: Any) -> list[dict[str, Any]]:
    """QA records with no questions of their own, to plant facts in: the first `per_document` windows of about
    `tokens` tokens of each (name, text), cut at line ends (a line longer than a window is one window). A text too
    short for one window is left out; every window kept holds at least 90% of `tokens`."""
    if tokens < 64 or per_document < 1:
        raise ValueError(f"windows need >= 64 tokens and >= 1 per document, got {tokens} and {per_document}")
    records, seen = [], {}
    for name, text in texts:
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # two files of one name (in two folders): ids, and so the planted facts, stay distinct
            name = f"{name}-{seen[name]}"
        lines, kept = text.splitlines(keepends=True), 0
        i = 0
        while i < len(lines) and kept < per_document:
            start, have = i, 0
            while i < len(lines) and have < tokens:
                have += len(tokenizer(lines[i], add_special_tokens=False)["input_ids"])
                i += 1
            if have < 0.9 * tokens:
                break
            kept += 1
            records.append({"id": f"{name}-w{kept - 1:02d}", "title": name, "document": "".join(lines[start:i]),
                            "qa": []})
    return records
