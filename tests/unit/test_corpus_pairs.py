"""`longdoc data pairs`: preference pairs from `data synth` records - rejected a value of the same document, never the
gold answer - in TRL's text and conversational formats that `data prepare --task preference` reads; counts by
reason, bad input in one line with exit 2, and on-policy answers of a tiny random model."""

from __future__ import annotations

import json

import pytest

from longdoc.cli import main
from longdoc.corpus import pairs
from longdoc.corpus.ingest import read_documents
from longdoc.corpus.prepare import prepare
from longdoc.corpus.synth import synthesize, write_jsonl
from longdoc.corpus.tokens import get_tokenizer


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def records(tok):
    return synthesize("legal", 1, 4096, seed=0, tokenizer=tok) + synthesize("medical", 1, 4096, seed=0, tokenizer=tok)


@pytest.fixture()
def qa_file(records, tmp_path):
    path = tmp_path / "qa.jsonl"
    write_jsonl(records, path)
    return str(path)


def _flat(text: str) -> str:
    return " ".join(text.split()).casefold()


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_pairs_rejected_is_a_value_of_the_same_document(records, qa_file, tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    assert main(["data", "pairs", qa_file, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _read(out)
    n_questions = sum(len(r["qa"]) for r in records)
    assert f"wrote {len(rows)} pairs (text format) from 2 documents" in printed
    assert f"made {len(rows)} pairs (" in printed and "document value" in printed
    made_skipped = printed.split("made ")[1]
    assert len(rows) + int(made_skipped.split("skipped ")[1].split()[0]) == n_questions
    by_id = {r["id"]: r for r in records}
    for row in rows:
        rec = by_id[row["doc_id"]]
        qa = next(q for q in rec["qa"] if q["id"] == row["qa_id"])
        assert row["prompt"] == f"{rec['document']}\n\nQuestion: {qa['question']}\nAnswer:"
        assert row["chosen"] == f" {qa['answer']}"
        rejected = row["rejected"].strip()
        assert not pairs.same_answer(rejected, qa["answer"]) and not any(
            pairs.same_answer(rejected, a) for a in qa["aliases"]), row
        others = [q["answer"] for q in rec["qa"] if q["id"] != qa["id"]]
        assert _flat(rejected) in _flat(rec["document"]) or rejected in others, row
        if row["rejected_from"] == "document value":
            assert _flat(rejected) in _flat(rec["document"])
    kinds = {r["kind"] for r in rows if r["rejected_from"] == "document value"}
    assert "distractor" in kinds, "a distractor question's rejected answer is its sibling value in the document"


def test_document_value_reads_the_sibling_fact():
    doc = ("Collected: 01/02/2020\n  Platelet count   202    x10^3/uL\n  Calcium   9.0  mg/dL\n\n"
           "Collected: 01/05/2020\n  Platelet count   188    x10^3/uL\n  Calcium   9.3  mg/dL\n")
    at = doc.index("9.0")
    qa = {"answer": "9.0", "aliases": [], "extractive": True, "spans": [[at - 12, at + 9]]}
    assert pairs.document_value(doc, qa) == "9.3"
    assert pairs.document_value(doc, {**qa, "extractive": False}) is None, "a computed answer is written nowhere"
    assert pairs.document_value(doc.replace("9.3", "9.0"), qa) is None, "the gold value is never the rejected one"


def test_chat_pairs_prepare_as_preference_rows(qa_file, tok, tmp_path, capsys):
    out = tmp_path / "pairs-chat.jsonl"
    assert main(["data", "pairs", qa_file, "--chat", "--out", str(out)]) == 0
    assert "(conversational format)" in capsys.readouterr().out
    rows = _read(out)
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["chosen"][0]["role"] == "assistant"
    pairs_read = list(read_documents([str(out)], task="preference"))
    assert len(pairs_read) == len(rows)
    ds = prepare(str(out), tok, task="preference", target_tokens=8192, cache_dir=tmp_path / "c")
    assert len(ds) == len(rows) and all(len(b) == 1 for b in ds["branches"])


def test_model_answers_counted_by_reason(records):
    docs = list(read_documents(records[:1], task="qa", keep=pairs.KEEP))
    qas = docs[0]["qas"]
    answers = [qas[0]["answer"], "", *(["certainly not this"] * (len(qas) - 2))]
    rows, made, skipped = pairs.build(docs, answers=[answers])
    assert made == {"model": len(qas) - 2}
    assert skipped == {"model answered correctly": 1, "model gave no answer": 1}
    assert all(r["rejected"] == " certainly not this" and r["rejected_from"] == "model" for r in rows)
    assert "made 6 pairs" in pairs.counts_line({"a": 6}, {}) and "skipped 0 questions (none)" in pairs.counts_line(
        {"a": 6}, {})


@pytest.mark.parametrize("args, says", [
    (["missing.jsonl"], "missing.jsonl"),
    (["TEXTS"], "record has no field 'document'"),
    (["QA", "--temperature", "-1"], "--temperature must be >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, qa_file, tmp_path, capsys):
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "just text"}) + "\n")
    args = [{"TEXTS": str(texts), "QA": qa_file}.get(a, a) for a in args]
    assert main(["data", "pairs", *args, "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("longdoc data pairs: ") and "\n" not in err and says in err


def test_on_policy_with_a_tiny_model_runs_and_counts(tok, tmp_path, capsys):
    small = synthesize("medical", 1, 1024, seed=1, tokenizer=tok)
    path = tmp_path / "small.jsonl"
    write_jsonl(small, path)
    n = len(small[0]["qa"])
    for extra in ([], ["--temperature", "1.0", "--seed", "3"]):
        out = tmp_path / "on-policy.jsonl"
        code = main(["data", "pairs", str(path), "--model", "tiny:llama", "--max-new-tokens", "4", "--out", str(out),
                     *extra])
        printed = capsys.readouterr().out
        made = int(printed.split("made ")[1].split()[0])
        skipped = int(printed.split("skipped ")[1].split()[0])
        assert made + skipped == n and code == (0 if made else 1)
        assert all(r["rejected_from"] == "model" for r in _read(out)) and len(_read(out)) == made
    first = _read(out)
    main(["data", "pairs", str(path), "--model", "tiny:llama", "--max-new-tokens", "4", "--out", str(out),
          "--temperature", "1.0", "--seed", "3"])
    assert _read(out) == first, "a seeded sample is the same sample"
