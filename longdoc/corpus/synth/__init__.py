"""Synthetic long documents with planted facts and checkable QA: legal case files, patient histories.

    longdoc data synth --domain legal --num-docs 4 --tokens 32768 --seed 0 --out legal.jsonl

    from longdoc.corpus.synth import synthesize, write_jsonl
    records = synthesize("medical", num_docs=4, tokens=32768, seed=0)   # default tokenizer (SmolLM2)
    write_jsonl(records, "medical.jsonl")

Each record (one JSON line):
    id, domain, seed, title, tokenizer, num_tokens (document length in that tokenizer), num_chars,
    qa: [{id, kind, template, question, answer, aliases, extractive,
          evidence: [{start, end, text, depth}], depth}],
    document
`document[start:end] == text` for every evidence span; `depth` is the position of the span's first
token as a fraction of the document's tokens (0 = start, 1 = end); a question's depth is that of
its first evidence span. When `extractive` is true the answer (or an alias) is written inside an
evidence span; counts, intervals and orderings are computed from their spans instead.

Documents hit `tokens` within 1% from 4096 tokens up, 2-3% at 1024-2048 (checked with a full
tokenization; 5% is the guarantee) and are deterministic: the same (domain, seed, index, tokens,
tokenizer) gives the same bytes in any process.

How a document is made: a domain simulator (`simulator.Simulator`: `legal_case.LegalCaseSimulator`,
`medical_chart.PatientChartSimulator`) keeps the case or chart state and offers `opening()`,
`next(progress)` (the next section; planted facts come due at their scheduled depths), `filler()` (an
inert section, free to add or drop), `closing()` (rendered from the current state, no side effects) and
`title()`. The engine (`engine.py`) tokenizes sections once each and sums them; a section that would
overshoot is undone (the simulator's state is restored), inert fillers close the gap, and a full
tokenization settles the length. Questions come from `<domain>_qa.questions`.

Modules (each imports only those listed above it):
    text                  data files, template filling, dates, money, times, names, answer aliases
    sections              Section (a piece of the document with marked spans) and Ref (one such span)
    questions             QA records and the Asker that phrases them from questions.json
    simulator             the Simulator protocol and Domain (a simulator with its question maker)
    legal_facts           what a case file plants: trial settings, demands, depositions, invoices, motions
    legal_state           the case state, declared, and the helpers every paper uses
    legal_discovery       depositions, exhibits, letters between counsel
    legal_case            the legal simulator: complaint, answer, scheduling, motions, orders, notices
    legal_qa              questions over a case file
    medical_facts         what a chart plants: dose settings, lab results, dated events
    medical_state         the chart state, declared, and the helpers every note uses
    medical_diagnostics   laboratory reports and imaging studies
    medical_chart         the medical simulator: admissions, progress notes, consults, discharges
    medical_qa            questions over a patient history
    engine                fitting documents to a token length, picking questions, the records
"""

from __future__ import annotations

from longdoc.corpus.synth.engine import DOMAINS, KINDS, MAX_TOKENS, MIN_TOKENS, synthesize, write_jsonl

__all__ = ["DOMAINS", "KINDS", "MAX_TOKENS", "MIN_TOKENS", "synthesize", "write_jsonl"]
