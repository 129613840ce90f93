"""`longdoc eval ...` end to end in one process (cp=1, tiny random model): run folders and compare."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from longdoc.cli import main
from longdoc.eval import report

DOC = " ".join(f"On day {i} the clerk docketed filing {i * 7 % 31} in the matter." for i in range(80))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = root / "qa.jsonl"
    data.write_text(json.dumps({"id": "d0", "domain": "legal", "num_tokens": 1000, "document": DOC,
                                "qa": [{"kind": "lookup", "question": "What was docketed on day 3?",
                                        "answer": "filing 21", "depth": 0.05}]}) + "\n")
    common = ["--model", "tiny:llama", "--threads", "1"]
    for name, seed in (("a", "0"), ("b", "1")):
        assert main(["eval", "needle", *common, "--domain", "medical", "--lengths", "128,256", "--depths", "0,1",
                     "--seed", seed, "--max-new-tokens", "4", "--out", str(root / name / "needle")]) == 0
        assert main(["eval", "position-loss", *common, "--data", str(data), "--buckets", "4",
                     "--out", str(root / name / "position-loss")]) == 0
    assert main(["eval", "qa", *common, "--data", str(data), "--max-new-tokens", "4", "--out",
                 str(root / "a" / "qa")]) == 0
    return root


def test_needle_run_folder(runs):
    res = report.load_results(runs / "a" / "needle")
    assert res["lengths"] == [128, 256] and res["depths"] == [0.0, 1.0]
    assert [len(row) for row in res["accuracy"]] == [2, 2] and len(res["cells"]) == 4
    assert {abs(c["doc_tokens"] - c["length"]) <= 3 for c in res["cells"]} == {True}
    assert res["config"]["cp"] == 1 and res["seconds"] > 0
    assert (runs / "a" / "needle" / "needle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Mean accuracy" in (runs / "a" / "needle" / "summary.md").read_text()


def test_position_loss_defaults_to_the_shortest_document(runs):
    res = report.load_results(runs / "a" / "position-loss")
    assert res["documents"] == 1 and res["skipped"] == 0 and res["buckets"] == 4
    assert sum(res["tokens"]) == res["length"] - 1  # every predicted token counted once


def test_compare_two_run_folders(runs, tmp_path):
    out = tmp_path / "cmp"
    assert main(["eval", "compare", str(runs / "a"), str(runs / "b"), "--names", "base", "tuned",
                 "--out", str(out)]) == 0
    res = report.load_results(out)
    assert res["names"] == ["base", "tuned"] and set(res) >= {"needle", "position-loss"} and "qa" not in res
    a = report.load_results(runs / "a" / "position-loss")
    assert res["position-loss"]["overall"]["a"] == a["overall"]
    assert {p.name for p in out.glob("*.png")} == {"compare_needle.png", "compare_position_loss.png"}
    md = (out / "summary.md").read_text()
    assert "# base vs tuned" in md and "## Needle in a haystack" in md and "## Document QA" not in md


def test_bad_input_fails_before_any_rank_starts(runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["eval", "qa", "--model", "tiny:llama", "--data", str(tmp_path / "missing.jsonl"), "--cp", "2"])
    with pytest.raises(ValueError, match="depths must be fractions"):
        main(["eval", "needle", "--model", "tiny:llama", "--depths", "0,1.5", "--cp", "2"])
    with pytest.raises(ValueError, match="needs --data"):
        main(["eval", "compare", "tiny:llama", "tiny:qwen3", "--tasks", "qa", "--out", str(tmp_path / "x")])
    with pytest.raises(FileNotFoundError, match="not an evaluation run folder"):
        report.load_results(tmp_path)


@pytest.mark.slow
def test_cli_compare_two_models_with_cp2(runs, tmp_path):
    """The `make demo` shape: two models, every task, --cp 2 spawned by the command itself."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "longdoc", "eval", "compare", "tiny:llama", "tiny:qwen3", "--names", "base", "tuned",
           "--data", str(runs / "qa.jsonl"), "--lengths", "128,256", "--depths", "0,0.5,1", "--domain", "medical",
           "--buckets", "4", "--max-new-tokens", "4", "--cp", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: {out}" in proc.stdout
    res = report.load_results(out)
    assert set(res) >= {"qa", "needle", "position-loss"}
    assert report.load_results(out / "tuned" / "qa")["config"]["cp"] == 2
    assert len(list(out.glob("compare_*.png"))) == 3


def test_model_and_lengths_are_checked_before_any_rank_starts(monkeypatch, tmp_path):
    """A mistyped model or a length past the model's context used to surface inside the spawned ranks, after they
    started and loaded the model (19-44 s at cp=2); the parent finds it from the model's config alone."""
    import longdoc.runtime.spawn
    from longdoc.train.config import RecipeError

    monkeypatch.setattr(longdoc.runtime.spawn, "run_local", lambda *a, **k: pytest.fail("the ranks started"))
    with pytest.raises(ValueError, match="unknown tiny architecture 'lama'"):
        main(["eval", "needle", "--model", "tiny:lama", "--lengths", "256", "--cp", "2"])
    with pytest.raises(FileNotFoundError, match="no such model folder or file"):
        main(["eval", "ruler", "--model", str(tmp_path / "no-such-model"), "--lengths", "2k", "--cp", "2"])
    with pytest.raises(RecipeError, match=r"--lengths 1048576 plus --max-new-tokens 32 exceeds the model's context "
                                          r"\(131072 tokens\); extend it with --rope-type yarn --rope-factor 16"):
        main(["eval", "needle", "--model", "tiny:llama", "--lengths", "1M", "--cp", "2"])
    with pytest.raises(RecipeError, match=r"--length 2097152 exceeds the model's context"):
        main(["eval", "position-loss", "--model", "tiny:llama", "--length", "2M", "--cp", "2"])
