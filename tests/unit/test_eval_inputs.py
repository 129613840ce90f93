"""What `longdoc eval` does with the inputs users bring: too-long prompts (refused before any compute, the
fix named), every format `longdoc data prepare` reads, folders and text files, the user's own haystack."""

from __future__ import annotations

import json
import time

import pytest

from longdoc.cli import main
from longdoc.eval import report
from longdoc.eval.runner import EvalInputError

DOC = " ".join(f"On day {i} the clerk docketed filing {i * 7 % 31} in the matter." for i in range(80))
COMMON = ["--threads", "1", "--max-new-tokens", "2"]


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny model folder whose context is 256 positions (no RoPE scaling), like SmolLM2's 8192."""
    from longdoc import models

    folder = tmp_path_factory.mktemp("m") / "short"
    model, tok = models.load("tiny:llama", max_position_embeddings=256)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"id": "d0", "document": DOC, "qa": [{"question": "What was docketed on day 3?",
                                                                     "answer": "filing 21"}]}) + "\n")
    return path


def test_eval_qa_refuses_a_prompt_past_the_context_before_any_compute(short_model, qa_file, tmp_path, monkeypatch):
    from longdoc.hf.session import KVSession

    def no_compute(*a, **k):
        raise AssertionError("a prefill ran before the length check")

    monkeypatch.setattr(KVSession, "prefill", no_compute)
    with pytest.raises(ValueError, match=r"document 'd0'.*prompt of \d+ tokens.*exceeds the model's context "
                                         r"\(256 tokens\).*--rope-type yarn --rope-factor \d.*no RoPE scaling"
                                         r".*fine-tuned with RoPE scaling.*shorter documents"):
        main(["eval", "qa", "--model", short_model, "--data", str(qa_file), *COMMON, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_eval_needle_and_position_loss_refuse_too(short_model, tmp_path):
    # checked in the parent, before any rank starts (longdoc.train.preflight): the length plus the answer budget
    with pytest.raises(ValueError, match=r"--lengths 512 plus --max-new-tokens \d+ exceeds the model's context \(256"):
        main(["eval", "needle", "--model", short_model, "--lengths", "128,512", "--depths", "0", *COMMON,
              "--out", str(tmp_path / "n")])
    with pytest.raises(ValueError, match=r"--length 512 exceeds the model's context \(256.*--rope-type"):
        main(["eval", "position-loss", "--model", short_model, "--length", "512", "--buckets", "4", "--threads", "1",
              "--out", str(tmp_path / "p")])


def test_eval_rope_option_extends_as_training_does(short_model, qa_file, tmp_path):
    from longdoc.eval.runner import load_model
    from longdoc.train.config import ModelConfig
    from longdoc.train.modeling import load_extended

    model, _ = load_model(short_model, {"rope_type": "yarn", "rope_factor": 8.0}, "cpu")
    trained, _ = load_extended(ModelConfig(name=short_model, rope_type="yarn", rope_factor=8.0))
    assert model.config.max_position_embeddings == trained.config.max_position_embeddings == 2048
    assert model.config.rope_parameters == trained.config.rope_parameters
    assert main(["eval", "qa", "--model", short_model, "--data", str(qa_file), *COMMON, "--rope-type", "yarn",
                 "--rope-factor", "8", "--out", str(tmp_path / "o")]) == 0
    with pytest.raises(ValueError, match="--rope-factor needs --rope-type"):
        main(["eval", "qa", "--model", short_model, "--data", str(qa_file), "--rope-factor", "2"])


def test_eval_qa_reads_flat_records_and_csv_like_prepare(tmp_path):
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"document": DOC, "question": "What was docketed on day 3?", "answer": "filing 21"})
                    + "\n")
    out = tmp_path / "o"
    assert main(["eval", "qa", "--model", "tiny:llama", "--data", str(flat), *COMMON, "--out", str(out)]) == 0
    rows = report.load_results(out)["rows"]
    assert len(rows) == 1 and rows[0]["answer"] == "filing 21"
    assert rows[0]["depth"] == pytest.approx(DOC.find("filing 21") / len(DOC))  # from the evidence span


def test_position_loss_takes_a_folder_and_a_txt_file(tmp_path):
    docs = tmp_path / "notes"
    docs.mkdir()
    (docs / "a.txt").write_text(DOC)
    (docs / "b.md").write_text(DOC[::-1])
    for data, n in ((docs, 2), (docs / "a.txt", 1)):
        out = tmp_path / f"o{n}"
        assert main(["eval", "position-loss", "--model", "tiny:llama", "--data", str(data), "--buckets", "4",
                     "--threads", "1", "--out", str(out)]) == 0
        assert report.load_results(out)["documents"] == n
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "case1").write_text(DOC)
    with pytest.raises(ValueError, match=r"1 file\(s\) without an extension \(case1\).*give them a \.txt extension"):
        main(["eval", "position-loss", "--model", "tiny:llama", "--data", str(bare)])


def test_needle_uses_the_users_haystack(tmp_path):
    docs = tmp_path / "contracts"
    docs.mkdir()
    text = " ".join(f"Clause {i}: the lessee shall pay rent number {i} on time." for i in range(60))
    (docs / "lease.txt").write_text(text)
    out = tmp_path / "o"
    started = time.time()
    assert main(["eval", "needle", "--model", "tiny:llama", "--haystack", str(docs), "--lengths", "128,256",
                 "--depths", "0.5", *COMMON, "--out", str(out)]) == 0
    assert time.time() - started < 120
    cells = report.load_results(out)["cells"]
    assert len(cells) == 2 and all(abs(c["doc_tokens"] - c["length"]) <= 3 for c in cells)
    with pytest.raises(EvalInputError, match="--haystack documents hold .* lower --lengths"):
        main(["eval", "needle", "--model", "tiny:llama", "--haystack", str(docs), "--lengths", "100000",
              "--depths", "0.5", *COMMON, "--out", str(out)])


def test_an_unreadable_haystack_file_stops_by_name_or_is_skipped_and_named(tmp_path, capsys):
    """An image among the --haystack documents: without --skip-bad one line naming it and the fix (exit 2) before
    any rank starts; with it (the flag `eval qa` has) the run goes on and names it, as `data prepare` does."""
    docs = tmp_path / "contracts"
    docs.mkdir()
    (docs / "lease.txt").write_text(" ".join(f"Clause {i}: the lessee shall pay rent number {i} on time."
                                             for i in range(60)))
    (docs / "scan.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(16))
    out = tmp_path / "o"
    args = ["eval", "needle", "--model", "tiny:llama", "--haystack", str(docs), "--lengths", "128", "--depths", "0.5",
            *COMMON, "--out", str(out)]
    assert main(args, catch=True) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scan.png: unsupported file type '.png'" in err, err
    assert "use --skip-bad to skip it and report it" in err and not out.exists()
    assert main([*args, "--skip-bad"]) == 0
    printed = capsys.readouterr()
    assert "needle: mean accuracy" in printed.out and "--haystack skipped 1 bad item(s)" in printed.out
    assert "--haystack: skipped " in printed.err and "scan.png" in printed.err
    res = report.load_results(out)
    assert res["skipped"]["total"] == 1 and "scan.png" in res["skipped"]["messages"][0]
    assert "(--skip-bad)" in (out / report.SUMMARY).read_text() and len(res["cells"]) == 1


def test_compare_names_each_haystack_file_left_out_once(tmp_path):
    """Both models read the same --haystack: `eval compare` names what --skip-bad left out once, with its task."""
    from longdoc.eval import compare, needle

    message = "docs/scan.png: unsupported file type '.png' in a folder"
    skipped = {"flag": "--haystack", "total": 1, "by_reason": {"unsupported file type": 1},
               "summary": f"skipped 1 bad item(s): 1 unsupported file type; first: {message}", "messages": [message]}
    runs = [{"needle": needle.write_report(tmp_path / name, {
        "task": "needle", "model": name, "domain": "legal", "lengths": [128], "depths": [0.5], "repeats": 1,
        "seed": 0, "accuracy": [[1.0]], "mean_accuracy": 1.0, "cells": [], "skipped": skipped})}
        for name in ("base", "tuned")]
    out = compare.write_comparison(*runs, ("base", "tuned"), tmp_path / "cmp")
    lines = compare.console_summary(report.load_results(out))
    assert [line for line in lines if "scan.png" in line] == [f"--haystack: skipped {message} (needle)"]
    assert "## Inputs left out (--skip-bad)" in (out / report.SUMMARY).read_text()


def test_spawned_ranks_hand_back_the_message_not_a_traceback(short_model, qa_file, tmp_path):
    """--cp 2 spawns ranks; each refuses alike before any collective, the parent raises the same exception (the
    type one process raises: training's context check, a RecipeError)."""
    from longdoc.train.config import RecipeError

    with pytest.raises(RecipeError, match=r"^document 'd0'.*exceeds the model's context \(256 tokens\)") as e:
        main(["eval", "qa", "--model", short_model, "--data", str(qa_file), *COMMON, "--cp", "2",
              "--out", str(tmp_path / "o")])
    assert "Traceback" not in str(e.value)


def test_the_general_set_rotates_every_sentence_over_each_length_in_one_prompt_length(tmp_path):
    """`--domain general` (the guard's needles): the guard's default grid (2 lengths x 5 depths x 2 repeats) holds
    each of the ten sentences once at every length, and a longer question takes its tokens from the haystack, so
    the prompts of one length differ by at most the few tokens a cut can move (they batch: needle.groups)."""
    from collections import Counter

    from longdoc.eval import needle

    docs = tmp_path / "manuals"
    docs.mkdir()
    text = "\n".join(f"Step {i}: turn the dial to position {i} and wait." for i in range(400))
    (docs / "manual.txt").write_text(text)
    out = tmp_path / "o"
    assert main(["eval", "needle", "--model", "tiny:llama", "--domain", "general", "--haystack", str(docs),
                 "--lengths", "256,512", "--depths", "0,0.25,0.5,0.75,1", "--repeats", "2", *COMMON,
                 "--out", str(out)]) == 0
    cells = report.load_results(out)["cells"]
    sentences = needle.NEEDLES["general"]
    for length in (256, 512):
        mine = [c for c in cells if c["length"] == length]
        assert Counter(c["template"] for c in mine) == Counter(range(len(sentences)))
        assert {c["question"] for c in mine} == {q for _, q in sentences}
        assert max(c["prompt_tokens"] for c in mine) - min(c["prompt_tokens"] for c in mine) <= 3, mine
    with pytest.raises(ValueError, match="--domain general has no generated haystack: pass --haystack"):
        main(["eval", "needle", "--model", "tiny:llama", "--domain", "general", "--lengths", "256", *COMMON,
              "--out", str(out)])
