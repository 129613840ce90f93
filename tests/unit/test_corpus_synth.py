"""Synthetic legal/medical documents: length in tokens, evidence spans, determinism, question kinds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from longdoc.corpus.synth import KINDS, synthesize, write_jsonl
from longdoc.corpus.synth.text import DATA_DIR, load_data
from longdoc.corpus.tokens import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def _check_records(records: list[dict], tok, target: int) -> None:
    for r in records:
        doc = r["document"]
        n = len(tok(doc, add_special_tokens=False)["input_ids"])
        assert n == r["num_tokens"], "recorded token count must be the real one"
        assert abs(n - target) <= 0.05 * target, f"{r['id']}: {n} tokens for target {target}"
        assert r["num_chars"] == len(doc)
        for q in r["qa"]:
            assert q["question"].strip() and q["answer"].strip() and q["kind"] in KINDS
            assert q["evidence"], q
            for ev in q["evidence"]:
                assert 0 <= ev["start"] < ev["end"] <= len(doc)
                assert doc[ev["start"]:ev["end"]] == ev["text"]
                assert 0.0 <= ev["depth"] <= 1.0
            assert q["depth"] == q["evidence"][0]["depth"]
            answers = [q["answer"].lower(), *(a.lower() for a in q["aliases"])]
            if q["extractive"]:
                assert any(a in ev["text"].lower() for a in answers for ev in q["evidence"]), q
            if q["kind"] == "count":
                assert int(q["answer"]) == len(q["evidence"]), q
            if q["kind"] == "temporal_order":
                assert q["answer"].lower() in q["question"].lower(), q


@pytest.mark.parametrize("domain", ["legal", "medical"])
def test_acceptance_4_docs_of_32k(domain, tok):
    t0 = time.perf_counter()
    records = synthesize(domain, num_docs=4, tokens=32768, seed=0, tokenizer=tok)
    elapsed = time.perf_counter() - t0
    assert elapsed < 40, f"4 x 32k {domain} documents took {elapsed:.1f}s"
    _check_records(records, tok, 32768)
    kinds = Counter(q["kind"] for r in records for q in r["qa"])
    assert len(kinds) >= 6 and {"multi_hop", "distractor", "count", "lookup"} <= set(kinds), kinds
    phrasings = defaultdict(set)
    for r in records:
        for q in r["qa"]:
            phrasings[q["kind"]].add(q["template"])
    assert all(len(t) >= 2 for t in phrasings.values()), phrasings
    assert len({r["document"][:2000] for r in records}) == 4, "documents must differ"
    spreads = [max(e["depth"] for e in q["evidence"]) - min(e["depth"] for e in q["evidence"])
               for r in records for q in r["qa"] if q["kind"] == "multi_hop"]
    assert max(spreads) > 0.1, "multi-hop questions should join facts far apart"
    depths = sorted(q["depth"] for r in records for q in r["qa"])
    assert depths[len(depths) // 4] < 0.5 < depths[3 * len(depths) // 4], "evidence spread over the documents"


@pytest.mark.parametrize("domain", ["legal", "medical"])
@pytest.mark.parametrize("tokens", [2048, 4096, 16384])
def test_other_lengths(domain, tokens, tok):
    records = synthesize(domain, num_docs=2, tokens=tokens, seed=3, tokenizer=tok)
    _check_records(records, tok, tokens)
    if tokens >= 4096:
        assert len({q["kind"] for r in records for q in r["qa"]}) >= 6


@pytest.mark.parametrize("domain", ["legal", "medical"])
def test_128k(domain, tok):
    _check_records(synthesize(domain, num_docs=1, tokens=131072, seed=0, tokenizer=tok), tok, 131072)


def test_same_seed_same_bytes_across_processes(tmp_path, tok):
    """A fresh process (other hash seed) through the CLI writes exactly what this process generates."""
    here = tmp_path / "here.jsonl"
    write_jsonl(synthesize("medical", num_docs=2, tokens=4096, seed=7, tokenizer=tok), here)
    write_jsonl(synthesize("medical", num_docs=2, tokens=4096, seed=7, tokenizer=tok), tmp_path / "again.jsonl")
    assert here.read_bytes() == (tmp_path / "again.jsonl").read_bytes()
    there = tmp_path / "there.jsonl"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "longdoc", "data", "synth", "--domain", "medical", "--num-docs", "2",
                          "--tokens", "4096", "--seed", "7", "--out", str(there)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "wrote 2 medical documents" in out.stdout
    assert there.read_bytes() == here.read_bytes()
    other = synthesize("medical", num_docs=1, tokens=4096, seed=8, tokenizer=tok)[0]
    assert other["document"] != json.loads(here.read_text().splitlines()[0])["document"]


@pytest.mark.parametrize("domain", ["legal", "medical"])
def test_question_data(domain):
    families = load_data(domain, "questions")
    kinds = {spec["kind"] for spec in families.values()}
    assert len(kinds) >= 6 and kinds <= set(KINDS), kinds
    for name, spec in families.items():
        assert len(spec["phrasings"]) >= 3, f"{name}: at least three phrasings"
        assert len(set(spec["phrasings"])) == len(spec["phrasings"])
        slots = [set(re.findall(r"{(\w+)}", p)) for p in spec["phrasings"]]
        assert all(s <= slots[0] | set().union(*slots) for s in slots)


def test_medical_vocabulary_is_consistent():
    v = load_data("medical", "vocab")
    meds, labs = v["medications"], v["labs"]
    for cond in v["conditions"]:
        assert set(cond["meds"]) <= set(meds), cond["name"]
        assert set(cond["imaging"]) <= set(v["imaging"]), cond["name"]
        assert set(cond["consults"]) <= set(v["consults"]), cond["name"]
    assert all(m in meds for ms in v["home_meds_by_pmh"].values() for m in ms)
    assert all(a in labs for panel in v["panels"].values() for a in panel)
    for name, lab in labs.items():
        assert lab["low"] <= lab["high"] and lab["unit"], name
    assert set(v["relation_sex"]) == set(v["relations"])
    assert set(load_data("medical", "templates")["chronic_plan"]) == set(v["pmh"])
    assert (DATA_DIR / "common" / "names.json").is_file()


def test_legal_vocabulary_is_consistent():
    v = load_data("legal", "vocab")
    for name, ct in v["case_types"].items():
        assert all(tag in ("plaintiff", "defense", "any") for tag, _, _ in ct["qa"]), name
        assert all(items for items in ct["vendors"].values()), name
        assert len(ct["facts"]) >= 5 and any("{incident_date}" in f for f in ct["facts"][:5]), name


def test_bad_arguments_name_the_valid_ones(tok):
    with pytest.raises(ValueError, match="domain must be one of"):
        synthesize("tax", 1, 4096, tokenizer=tok)
    with pytest.raises(ValueError, match=r"tokens must be in \[1024"):
        synthesize("legal", 1, 100, tokenizer=tok)


@pytest.mark.parametrize("domain", ["legal", "medical"])
def test_simulators_follow_the_protocol_and_declare_their_state(domain):
    """Every attribute a simulator sets is declared in its state class (the parts that read it can see it)."""
    import random

    from longdoc.corpus.synth.legal_case import LegalCaseSimulator
    from longdoc.corpus.synth.legal_state import CaseState
    from longdoc.corpus.synth.medical_chart import PatientChartSimulator
    from longdoc.corpus.synth.medical_state import ChartState
    from longdoc.corpus.synth.simulator import Simulator

    cls, state = {"legal": (LegalCaseSimulator, CaseState), "medical": (PatientChartSimulator, ChartState)}[domain]
    sim = cls(random.Random("probe"), 16384, "probe")
    assert isinstance(sim, Simulator) and sim.domain == domain
    sim.opening()
    for step in range(80):
        sim.next(step / 80)
        sim.filler()
    sim.closing()
    undeclared = set(vars(sim)) - set(state.__annotations__)
    assert not undeclared, f"{cls.__name__} sets {sorted(undeclared)} without declaring them in {state.__name__}"
    assert not set(state.__annotations__) & set(vars(state)), "declared state must not have class-level values"
