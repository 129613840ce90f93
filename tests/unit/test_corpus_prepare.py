"""`longdoc data prepare`: windows at the target length, QA windows with their evidence, input formats,
malformed input reported with file and line, counted skips, caching, and the CLI."""

from __future__ import annotations

import json
import os
import time

import pytest

from longdoc.corpus.ingest import CorpusError, Fields, Skips
from longdoc.corpus.prepare import prepare, save
from longdoc.corpus.qa_format import qa_parts
from longdoc.corpus.synth import synthesize, write_jsonl
from longdoc.corpus.tokens import get_tokenizer
from longdoc.corpus.windows import IGNORE


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def synth(tmp_path_factory, tok):
    records = (synthesize("legal", 2, 8192, seed=0, tokenizer=tok)
               + synthesize("medical", 1, 8192, seed=0, tokenizer=tok))
    path = tmp_path_factory.mktemp("synth") / "docs.jsonl"
    write_jsonl(records, path)
    return path, records


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def test_pretrain_windows_at_target(synth, tok, cache):
    path, records = synth
    ds = prepare(str(path), tok, task="pretrain", target_tokens=2048, overlap=256, cache_dir=cache)
    for rec in records:
        ids = tok(rec["document"])["input_ids"] + [tok.eos_token_id]
        rows = [r for r in ds if r["doc_ids"] == [rec["id"]]]
        assert len(rows) >= 4 and all(r["num_tokens"] == 2048 for r in rows), "long documents -> full windows"
        scored = []
        for r in rows:
            start = r["token_starts"][0]
            assert r["input_ids"] == ids[start:start + 2048]
            assert r["position_ids"] == list(range(2048)) and r["cu_seqlens"] == [0, 2048]
            assert r["sources"][0].startswith(f"{path}:")
            scored += [x for x in r["labels"] if x != IGNORE]
        assert scored == ids, "every token scored exactly once"
        assert sum(r["num_loss_tokens"] for r in rows) == len(ids) - 1


@pytest.mark.parametrize("target", [768, 1536])
def test_qa_windows_keep_their_evidence(synth, tok, cache, target):
    path, records = synth
    ds = prepare([str(path)], tok, task="qa", target_tokens=target, cache_dir=cache, num_proc=2 if target == 768 else 1,
                 questions_per_row=1)
    qas = {q["id"]: q for r in records for q in r["qa"]}
    assert sorted(ds["qa_id"]) == sorted(qas)
    split = 0
    for row in ds:
        q = qas[row["qa_id"]]
        assert row["num_tokens"] <= target and row["kind"] == q["kind"]
        text = tok.decode(row["input_ids"])
        for ev in q["evidence"]:
            assert ev["text"] in text, (row["qa_id"], ev["text"])
        assert text.rstrip().endswith(q["answer"] + "<|im_end|>")
        assert q["question"] in text
        answer = [x for x in row["labels"] if x != IGNORE]
        assert tok.decode(answer) == q["answer"] + "<|im_end|>", "loss on the answer tokens only"
        assert row["labels"][-len(answer):] == row["input_ids"][-len(answer):]
        split += len(row["doc_pieces"]) > 1
    assert split, "far-apart evidence at a small target must come as several pieces"


def test_qa_short_documents_are_whole(tok, cache):
    doc = "The invoice number is A-1234 and the total due is $5,300.00. Payment is due in 30 days."
    rec = {"id": "d1", "document": doc, "qa": [{"question": "What is the total due?", "answer": "$5,300.00"}]}
    (row,) = prepare([rec], tok, task="qa", target_tokens=512, cache_dir=cache)
    n = len(tok(doc, add_special_tokens=False)["input_ids"])
    assert row["doc_pieces"] == [[0, n]] and doc in tok.decode(row["input_ids"])
    assert row["sources"] == ["record 1"] and row["qa_id"] == "d1#0"


def _write_formats(folder, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": f"doc{i}", "text": t} for i, t in enumerate(texts)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "a.json").write_text(json.dumps(rows, indent=2))
    with open(folder / "a.csv", "w", newline="") as f:
        import csv

        w = csv.DictWriter(f, ["id", "text"])
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), folder / "a.parquet")
    (folder / "txt").mkdir()
    for i, t in enumerate(texts):
        (folder / "txt" / f"{i:02d}.{'md' if i % 2 else 'txt'}").write_text(t)


def test_every_input_format_gives_the_same_rows(tmp_path, tok, cache):
    texts = ["First line.\nSecond line, with \"quotes\", commas and ünïcode.\n" * 40, "Short note.", "x " * 900]
    _write_formats(tmp_path, texts)
    results = {}
    for name in ("a.jsonl", "a.json", "a.csv", "a.parquet", "txt"):
        ds = prepare(str(tmp_path / name), tok, task="pretrain", target_tokens=256, overlap=32, cache_dir=cache)
        results[name] = ds["input_ids"]
    assert all(r == results["a.jsonl"] for r in results.values())
    assert len(results["a.jsonl"]) > 3


BAD = [  # (file name, content, expected message, reason)
    ("bad.jsonl", b'{"text": "fine"}\n\n{"text": "   "}\n', r"bad\.jsonl:3: field 'text' is empty", "empty document"),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"bad\.jsonl:2: invalid UTF-8", "invalid UTF-8"),
    ("bad.jsonl", b'{"text": "fine"}\n{"body": "x"}\n', r"bad\.jsonl:2: record has no field 'text'.*--text-field",
     "missing field"),
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n{"text": "d"\n', r"bad\.jsonl:4: not valid JSON",
     "invalid JSON"),
    ("bad.json", b'[\n  {"text": "a"},\n  {"text": "b"},\n\n  {"other": 1}\n]\n',
     r"bad\.json:5: record has no field 'text'", "missing field"),
    ("bad.csv", b'id,text\n1,"two\nlines"\n2,\n3,fine\n', r"bad\.csv:4: field 'text' is empty", "empty document"),
    ("bad.csv", b'id,text\n1,ok\n2,\xff\xfe bad\n', r"bad\.csv:3: invalid UTF-8", "invalid UTF-8"),
    ("bad.json", b'[\n  {"text": "a"},\n  {"text": "caf\xe9"}\n]\n', r"bad\.json:3: invalid UTF-8", "invalid UTF-8"),
]


@pytest.mark.parametrize("name,content,message,reason", BAD)
def test_malformed_pretrain_input_names_file_and_line(tmp_path, tok, cache, name, content, message, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CorpusError, match=message):
        prepare(str(path), tok, task="pretrain", target_tokens=256, cache_dir=cache)
    if reason != "invalid JSON" or name.endswith(".jsonl"):
        skips = Skips()
        ds = prepare(str(path), tok, task="pretrain", target_tokens=256, cache_dir=cache, skips=skips)
        assert skips.counts == {reason: 1} and len(ds) >= 1
        assert str(path) in skips.summary()


QA_BAD = [
    ('{"document": "The dose was 5 mg.", "question": "Dose?", "answer": "10 mg"}',
     r"qa\.jsonl:2: answer '10 mg' not found in the document", "answer not found"),
    ('{"document": "The dose was 5 mg.", "qa": [{"question": "Q?", "answer": "5 mg"}, {"question": "Q?", '
     '"answer": "7 mg"}]}', r"qa\.jsonl:2: qa\[1\]: answer '7 mg' not found", "answer not found"),
    ('{"document": "The dose was 5 mg.", "question": "Dose?", "answer": "5", "evidence": [{"start": 3, "end": 99}]}',
     r"qa\.jsonl:2: evidence\[0\] must be", "bad evidence span"),
    ('{"document": "", "question": "Dose?", "answer": "5"}', r"qa\.jsonl:2: field 'document' is empty",
     "empty document"),
    ('{"document": "The dose was 5 mg.", "question": "Dose?"}', r"qa\.jsonl:2: record has no field 'answer'",
     "missing field"),
]


@pytest.mark.parametrize("line,message,reason", QA_BAD)
def test_malformed_qa_input_names_file_and_line(tmp_path, tok, cache, line, message, reason):
    good = '{"document": "Trial is set for May 3, 2022.", "question": "When is trial?", "answer": "May 3, 2022"}'
    path = tmp_path / "qa.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(CorpusError, match=message):
        prepare(str(path), tok, task="qa", target_tokens=256, cache_dir=cache)
    skips = Skips()
    ds = prepare(str(path), tok, task="qa", target_tokens=256, cache_dir=cache, skips=skips)
    assert skips.counts[reason] == 1 and "May 3, 2022" in tok.decode(ds[0]["input_ids"])


def test_bad_text_file_in_folder_and_bad_parquet_row(tmp_path, tok, cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("good\n")
    (tmp_path / "docs" / "b.txt").write_bytes(b"line one\nline two\nbad \x91quote\n")
    with pytest.raises(CorpusError, match=r"b\.txt:3: invalid UTF-8.*iconv"):
        prepare(str(tmp_path / "docs"), tok, target_tokens=256, cache_dir=cache)
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": ""}]), tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p\.parquet row 2: field 'text' is empty"):
        prepare(str(tmp_path / "p.parquet"), tok, target_tokens=256, cache_dir=cache)
    with pytest.raises(CorpusError, match="no such file or folder"):
        prepare(str(tmp_path / "missing.jsonl"), tok, target_tokens=256, cache_dir=cache)


def test_skip_bad_counts_everything_left_out(tmp_path, tok, cache):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": ""}\n{"text": "three"}\nnot json\n{"text": "five"}\n')
    skips = Skips()
    ds = prepare(str(path), tok, target_tokens=256, cache_dir=cache, skips=skips)
    assert len(ds) == 3 and skips.total == 2
    summary = skips.summary()
    assert "1 empty document" in summary and "1 invalid JSON" in summary and "mixed.jsonl:2" in summary


def test_evidence_too_far_apart_for_the_target(tmp_path, tok, cache):
    filler = " ".join(f"word{i}" for i in range(3000))
    doc = "Alpha fact: " + "a b c d " * 120 + filler + " Beta fact: " + "e f g h " * 120
    rec = {"document": doc, "question": "Q?", "answer": "x",
           "evidence": [{"start": 0, "end": 900}, {"start": len(doc) - 900, "end": len(doc)}]}
    path = tmp_path / "far.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(CorpusError, match=r"far\.jsonl:1: question .*evidence needs \d+ tokens"):
        prepare(str(path), tok, task="qa", target_tokens=256, cache_dir=cache)
    skips = Skips()
    with pytest.raises(CorpusError, match="no rows left: skipped 1 bad item"):
        prepare(str(path), tok, task="qa", target_tokens=256, cache_dir=cache, skips=skips)
    assert skips.counts["evidence does not fit"] == 1


def test_results_are_cached(synth, tok, cache):
    path, _ = synth
    t0 = time.perf_counter()
    first = prepare(str(path), tok, task="qa", target_tokens=1024, cache_dir=cache)
    t1 = time.perf_counter()
    second = prepare(str(path), tok, task="qa", target_tokens=1024, cache_dir=cache)
    t2 = time.perf_counter()
    assert first.cache_files == second.cache_files and first["input_ids"] == second["input_ids"]
    assert t2 - t1 < t1 - t0
    other = prepare(str(path), tok, task="qa", target_tokens=1000, cache_dir=cache)
    assert other.cache_files != first.cache_files, "another option must not reuse the cache"


def test_packing_is_opt_in(tmp_path, tok, cache):
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": f"note {i}: " + "word " * (10 + 7 * i)}) + "\n" for i in range(12)))
    plain = prepare(str(path), tok, target_tokens=128, cache_dir=cache)
    assert all(r == [0, n] for r, n in zip(plain["cu_seqlens"], plain["num_tokens"]))
    packed = prepare(str(path), tok, target_tokens=128, pack=True, cache_dir=cache)
    assert len(packed) < len(plain) and max(packed["num_tokens"]) <= 128
    row = next(r for r in packed if len(r["cu_seqlens"]) > 2)
    b = row["cu_seqlens"][1]
    assert row["position_ids"][b] == 0 and row["labels"][b] == IGNORE and len(row["doc_ids"]) >= 2
    with pytest.raises(ValueError, match="pack=True is for task='pretrain'"):
        prepare(str(path), tok, task="qa", pack=True, cache_dir=cache)


def test_plain_prompt_without_chat_template(tok):
    parts = qa_parts(tok, "When?", "Monday", use_chat_template=False)
    assert parts.prefix == [] and tok.decode(parts.suffix) == "\n\nQuestion: When?\nAnswer:"
    assert tok.decode(parts.answer) == " Monday" + tok.eos_token


def test_hub_id_that_cannot_load_is_a_clear_error(tok, cache, monkeypatch):
    import datasets
    import huggingface_hub.constants

    # The environment variables are read at import time; set the flags themselves (no network in tests).
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CorpusError, match="loading it as a hub dataset failed"):
        prepare("longdoc-test/no-such-dataset", tok, target_tokens=256, cache_dir=cache)


def test_cli_prepare_and_save(synth, tmp_path, cache, capsys):
    from longdoc.cli import main

    path, records = synth
    out = tmp_path / "rows.parquet"
    assert main(["data", "prepare", str(path), "--task", "qa", "--target-tokens", "1024", "--out", str(out),
                 "--cache-dir", str(cache), "--questions-per-row", "1"]) == 0
    assert f"rows from {len(records)} documents" in capsys.readouterr().out
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert len(ds) == sum(len(r["qa"]) for r in records) and max(ds["num_tokens"]) <= 1024
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": ""}\n')
    assert main(["data", "prepare", str(bad), "--out", str(tmp_path / "x"), "--cache-dir", str(cache)]) == 2
    assert f"{bad}:3: field 'text' is empty" in capsys.readouterr().err
    assert main(["data", "prepare", str(bad), "--out", str(tmp_path / "x"), "--cache-dir", str(cache),
                 "--skip-bad", "--target-tokens", "256"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 bad item(s): 1 empty document" in captured.err
    assert save(prepare(str(bad), None, target_tokens=256, cache_dir=cache, skips=Skips()),
                tmp_path / "x.jsonl") == "jsonl"
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 2


def test_field_names_are_configurable(tmp_path, tok, cache):
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"key": "k1", "body": "Dose is 40 mg daily.", "q": "Dose?", "a": "40 mg"}) + "\n")
    ds = prepare(str(path), tok, task="qa", target_tokens=256, cache_dir=cache,
                 fields=Fields(document="body", question="q", answer="a", id="key"))
    assert ds[0]["doc_ids"] == ["k1"]
    assert os.path.basename(ds[0]["sources"][0]) == "custom.jsonl:1"
