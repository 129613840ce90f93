"""`longdoc data plant`: artificial retrieval facts in QA documents, each with one question whose answer is in the
text exactly once; the record's own evidence moves with the inserted text; no template shared with the evaluation's
needles or the RULER-style suite."""

from __future__ import annotations

import json
import re

import pytest

from longdoc.corpus import plant
from longdoc.eval import needle


def _record():
    doc = "\n".join(f"Entry {i}: the clerk filed motion {i * 7 % 31} on day {i}. It was granted." for i in range(40))
    start = doc.index("motion 4 ")
    return {"id": "d0", "document": doc, "qa": [{"id": "q0", "kind": "lookup", "question": "Which motion?",
                                                  "answer": "motion 4", "evidence": [
                                                      {"start": start, "end": start + 8, "text": "motion 4"}]}]}


def test_facts_are_planted_with_their_questions_and_evidence_moves():
    rec = _record()
    out = plant.plant(rec, 5, seed=3)
    assert out == plant.plant(rec, 5, seed=3), "a pure function of (record, facts, seed)"
    assert out["document"] != plant.plant(rec, 5, seed=4)["document"]
    text = out["document"]
    added = [q for q in out["qa"] if q["kind"] == "retrieval"]
    assert len(added) == 5 and len(out["qa"]) == 6 and rec["qa"][0]["evidence"][0]["start"] < len(rec["document"])
    for q in out["qa"]:
        e = q["evidence"][0]
        assert text[e["start"]:e["end"]] == e["text"] == (q["answer"] if q["kind"] == "retrieval" else "motion 4")
        assert q["depth"] == pytest.approx(e["start"] / len(text), abs=1e-4)
    for q in added:
        assert len(re.findall(re.escape(q["answer"]), text)) == 1, "each answer stands once in the text"
    assert len({q["question"] for q in added}) == 5


def test_no_evaluation_template_is_reused():
    own = " ".join(plant._ENTITIES + plant._ATTRIBUTES + plant._FACTS + plant._QUESTIONS + plant._WORDS)
    for fact, question in [p for pairs in needle.NEEDLES.values() for p in pairs]:
        for word in set(re.findall(r"[a-z']{5,}", (fact + " " + question).lower())) - {"value", "what", "number"}:
            assert word not in own.lower(), word  # combination, evidence, permit, cabinet, ... (not "number")
    assert "magic" not in own.lower()


def test_cli_writes_and_refuses_bad_input(tmp_path, capsys):
    from longdoc.cli import main

    src = tmp_path / "qa.jsonl"
    src.write_text(json.dumps(_record()) + "\n")
    assert main(["data", "plant", str(src), "--facts", "2", "--out", str(tmp_path / "out.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and sum(q["kind"] == "retrieval" for q in rows[0]["qa"]) == 2
    capsys.readouterr()
    assert main(["data", "plant", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longdoc data plant:")
    assert main(["data", "plant", str(src), "--facts", "0", "--out", str(tmp_path / "x.jsonl")]) == 2


def test_no_fact_lands_inside_a_multi_sentence_evidence():
    rec = _record()
    doc = rec["document"]
    start = doc.index("Entry 3:")
    end = doc.index("Entry 30:")  # 27 lines of sentence boundaries inside one evidence span
    rec["qa"].append({"id": "q1", "kind": "interval", "question": "What happened?", "answer": "motion 21",
                      "evidence": [{"start": start, "end": end, "text": doc[start:end]}]})
    for seed in range(20):
        out = plant.plant(rec, 8, seed)
        for q in out["qa"]:
            for e in q["evidence"]:
                assert out["document"][e["start"]:e["end"]] == e["text"], (seed, q["id"])


class _Words:
    """A tokenizer stand-in: one token per word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_windows_cut_plain_documents_at_line_ends():
    text = "".join(f"line {i} has five words\n" for i in range(210))  # 5 tokens a line
    records = plant.windows([("doc", text), ("short", "too short\n")], 100, 3, _Words())
    assert [r["id"] for r in records] == ["doc-w00", "doc-w01", "doc-w02"], "the short text holds no window"
    assert records[0]["document"].startswith("line 0 ") and records[1]["document"].startswith("line 20 ")
    assert all(len(r["document"].split()) == 100 and r["qa"] == [] for r in records)
    out = plant.plant(records[0], 4, seed=0)
    assert [q["kind"] for q in out["qa"]] == ["retrieval"] * 4
    assert plant.windows([("doc", text)], 100, 30, _Words())[-1]["id"] == "doc-w09", "a partial last window is dropped"
    with pytest.raises(ValueError, match="64 tokens"):
        plant.windows([("doc", text)], 10, 1, _Words())
    twins = plant.windows([("doc", text), ("doc", text)], 100, 1, _Words())
    assert [r["id"] for r in twins] == ["doc-w00", "doc-2-w00"], "files of one name in two folders stay apart"


def test_cli_plants_in_windows_of_plain_text(tmp_path, capsys):
    from longdoc.cli import main

    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("alpha", "beta"):
        (folder / f"{name}.txt").write_text("".join(f"The {name} manual, section {i}. It explains one thing.\n"
                                                   for i in range(400)))
    out = tmp_path / "rows.jsonl"
    assert main(["data", "plant", str(folder), "--windows", "512", "--facts", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["alpha-w00", "beta-w00"]
    assert all(len(r["qa"]) == 3 and r["document"].startswith(f"The {r['title']} manual") for r in rows)
    capsys.readouterr()
    assert main(["data", "plant", str(folder), "--windows", "100k", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smaller --windows" in err[0]
    assert main(["data", "plant", str(folder / "alpha.txt"), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--windows TOKENS" in capsys.readouterr().err


def test_cli_windows_skip_bad_files_by_name(tmp_path, capsys):
    from longdoc.cli import main

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.txt").write_text("".join(f"Note {i}: the notes explain one thing.\n" for i in range(300)))
    (folder / "scan.png").write_bytes(b"\x89PNG\r\n")
    out = tmp_path / "rows.jsonl"
    assert main(["data", "plant", str(folder), "--windows", "512", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scan.png" in err[0] and "--skip-bad" in err[0]
    assert main(["data", "plant", str(folder), "--windows", "512", "--skip-bad", "--out", str(out)]) == 0
    assert "scan.png" in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["notes-w00"]
