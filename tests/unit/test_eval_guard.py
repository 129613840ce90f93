"""`longdoc eval guard BASE TUNED --text DIR`: the no-harm verdict rule on crafted pairs, end to end with tiny
random models (a model against itself: NO HARM, exit 0; against a copy whose logits are blown up: HARM, exit 1;
a base reused from an earlier guard's folder), and bad input as one line and exit 2 before any rank starts."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from longdoc.cli import main
from longdoc.eval import guard, harm, report

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the court held that the lease was void because the tenant failed to give written notice within thirty "
         "days of the breach and the landlord kept the deposit").split()
# Short lengths, two depths, one needle a cell: 4 paired cells and 4 windows x 4 buckets, seconds per model.
FAST = ["--lengths", "64,128", "--depths", "0,1", "--repeats", "1", "--max-new-tokens", "2", "--windows", "4",
        "--buckets", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A folder of held-out plain text: three short .txt files (about 450 tokens in all: 3 windows of 128)."""
    folder = tmp_path_factory.mktemp("heldout")
    rng = random.Random(0)
    for i in range(3):
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(50)).capitalize() + "." for _ in range(3)]
        (folder / f"doc{i}.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """tiny:llama saved as a folder, and a copy whose final norm is scaled 50x: its logits are 50x sharper at
    random, so its plain-text loss is far above the base's (a harmed fine-tune)."""
    import torch

    from longdoc import models

    root = tmp_path_factory.mktemp("models")
    model, tokenizer = models.load("tiny:llama")
    for name, scale in (("base", 1.0), ("harmed", 50.0)):
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"base": root / "base", "harmed": root / "harmed"}


def _cells(correct: list[int], length: int = 1024, sentences: int = 10) -> list[dict]:
    return [{"length": length, "depth": 0.5, "repeat": r, "question": f"sentence {r % sentences}?",
             "answer": str(10000 + r), "correct": bool(c)} for r, c in enumerate(correct)]


def _windows(rows: list[list[float]]) -> dict:
    return {"per_document": {"keys": [f"w{i}" for i in range(len(rows))], "bucket_loss": rows}}


def test_verdict_rule_on_crafted_pairs():
    rng = random.Random(1)
    base = [int(rng.random() < 0.6) for _ in range(40)]
    dropped = [c if r % 3 else 0 for r, c in enumerate(base)]  # a third of the hits lost: a clear, real drop
    j = harm.judge({"needle": ({"cells": _cells(base)}, {"cells": _cells(dropped)})})
    m = j["metrics"]["needle"]
    assert m["harm"] and j["verdict"] == "HARM" and m["high"] < 0 and -m["delta"] > harm.NEEDLE_TOLERANCE
    assert j["line"].startswith(f"guard: HARM (needle {m['base']:.2f} -> {m['tuned']:.2f}, delta {m['delta']:+.2f}")
    assert "beyond the 0.05 tolerance" in j["line"]
    # A real drop within tolerance (12 of 400 cells: 0.03, interval below 0) is no harm.
    many, lost = [1] * 400, [0 if r < 12 else 1 for r in range(400)]
    m = harm.judge({"needle": ({"cells": _cells(many)}, {"cells": _cells(lost)})})["metrics"]["needle"]
    assert m["high"] < 0 and m["delta"] == pytest.approx(-0.03) and not m["harm"]
    # Cells resample by sentence: one sentence lost at every cell (4 of 40) is that sentence's, not retrieval's;
    # the same drop spread over four sentences is harm. Resampling single cells would call both harm.
    one = [0 if r % 10 == 0 else 1 for r in range(40)]
    spread = [0 if r in (0, 11, 22, 33) else 1 for r in range(40)]
    for tuned, harmed in ((one, False), (spread, True)):
        m = harm.judge({"needle": ({"cells": _cells([1] * 40)}, {"cells": _cells(tuned)})})["metrics"]["needle"]
        assert m["delta"] == pytest.approx(-0.1) and m["harm"] is harmed and m["paired"]["groups"] == 10, m
    from longdoc.eval.compare import paired_bootstrap
    assert paired_bootstrap([1.0] * 40, [float(x) for x in one])["high"] < 0  # per cell: "harm"
    # Plain-text loss: +10% everywhere is harm; +1% everywhere is real but within the 2% tolerance; noise is not.
    rows = [[3.0 + 0.1 * rng.random() for _ in range(8)] for _ in range(6)]
    for factor, harmed in ((1.10, True), (1.01, False)):
        worse = [[x * factor for x in row] for row in rows]
        m = harm.judge({"position-loss": (_windows(rows), _windows(worse))})["metrics"]["position-loss"]
        assert m["harm"] is harmed and m["delta"] == pytest.approx(factor - 1, rel=1e-6), factor
        assert m["n"] == 48 and m["low"] > 0
    noisy = [[x + rng.gauss(0, 0.05) for x in row] for row in rows]
    j = harm.judge({"position-loss": (_windows(rows), _windows(noisy))}, loss_tolerance=0.0)
    m = j["metrics"]["position-loss"]
    assert j["verdict"] == "NO HARM" and m["low"] < 0 < m["high"]
    assert j["line"] == (f"guard: NO HARM (plain-text loss {m['delta']:+.1%} [{m['low']:+.1%}, {m['high']:+.1%}])")
    # Ruler pairs sample by sample, with the needle tolerance.
    rows_a = [{"task": "niah_single", "length": 1024, "index": i, "references": [str(i)], "score": 1.0}
              for i in range(30)]
    rows_b = [{**r, "score": 0.0 if r["index"] % 2 else 1.0} for r in rows_a]
    m = harm.judge({"ruler": ({"rows": rows_a}, {"rows": rows_b})})["metrics"]["ruler"]
    assert m["harm"] and m["n"] == 30 and m["delta"] == pytest.approx(-0.5)
    # Items without a twin are an error, never dropped in silence.
    with pytest.raises(ValueError, match=r"cannot pair the two runs: 2 needle cells have no twin on the other side "
                                         r"\(39 paired"):
        harm.judge({"needle": ({"cells": _cells(base)}, {"cells": _cells(base[:39]) + _cells([1], 2048)})})


def test_default_repeats_reach_20_cells():
    cfg = {"lengths": [1024, 2048], "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "repeats": None, "text": "x",
           "windows": 16, "buckets": 16, "needle_tolerance": 0.05, "loss_tolerance": 0.02}
    shared, overrides, names = guard.plan({**cfg, "base": "b", "tuned": "t"})
    assert shared["repeats"] == 2 and names == ["needle", "position-loss"]
    assert not {"base", "tuned", "needle_tolerance", "loss_tolerance", "windows"} & set(shared)  # cache keys
    assert overrides["position-loss"]["length"] == 2048 and overrides["position-loss"]["pack"] is True
    shared, _, names = guard.plan({**cfg, "lengths": [1024], "depths": [0.5], "ruler_samples": 3})
    assert shared["repeats"] == 20 and names[-1] == "ruler"


def test_guard_figure_draws_both_sides_in_each_panel():
    from longdoc.eval import plots

    data = {"names": ["base", "tuned"], "needle": {"lengths": [1024, 2048], "a": [0.9, 0.8], "b": [0.5, None]},
            "position": {"centers": [8.0, 24.0], "a": [3.0, 2.5], "b": [3.1, 2.7]},
            "ruler": {"lengths": [1024, 2048], "a": [0.7, 0.6], "b": [0.7, 0.5]}}
    fig = plots.guard_figure(data)
    assert [len(ax.lines) for ax in fig.axes] == [2, 2, 2]
    assert list(fig.axes[0].lines[1].get_ydata()) == [0.5]  # a length without cells is left out, not drawn as 0
    assert len(plots.guard_figure({**data, "ruler": None}).axes) == 2


def _last_line(capsys) -> tuple[str, str]:
    out = capsys.readouterr()
    return out.out.strip().splitlines()[-1], out.err


def test_base_against_itself_is_no_harm_and_a_guard_folder_is_reused(text, tmp_path, capsys):
    out, cache = tmp_path / "guard", ["--cache-dir", str(tmp_path / "cache")]
    assert main(["eval", "guard", "tiny:llama", "tiny:llama", "--text", str(text), *FAST, *cache,
                 "--out", str(out)]) == 0
    line, _ = _last_line(capsys)
    assert line.startswith("guard: NO HARM (needle ") and "plain-text loss +0.0% [+0.0%, +0.0%]" in line
    res = report.load_results(out)
    assert res["verdict"] == "NO HARM" and res["line"] == line
    windows = report.load_results(out / "tuned" / "position-loss")
    assert windows["pack"] is True and windows["length"] == 128 and 2 <= windows["documents"] <= 4
    assert res["metrics"]["needle"]["n"] == 4 and res["metrics"]["position-loss"]["n"] == 4 * windows["documents"]
    per_window = windows["per_document"]["loss"]  # equal windows: their mean is the overall mean
    assert len(set(windows["per_document"]["keys"])) == len(per_window) == windows["documents"]
    assert sum(per_window) / len(per_window) == pytest.approx(windows["overall"], rel=1e-9)
    assert {p.name for p in (out / "base").iterdir()} == {"needle", "position-loss"}
    assert (out / "guard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "summary.md").read_text()
    assert "| needle (accuracy) |" in md and "| plain-text loss (nats/token) |" in md and f"**{line}**" in md
    # An earlier guard's folder as BASE: its base/ runs are reused, only the tuned model is evaluated.
    again = tmp_path / "again"
    assert main(["eval", "guard", str(out), "tiny:llama", "--text", str(text), *FAST, *cache, "--needle-tolerance",
                 "0.1", "--out", str(again)]) == 0
    line_again, err = _last_line(capsys)
    assert line_again == line
    # ... and the tuned model's results come from run_suite's content cache: the tasks' settings hold neither the
    # other model's name nor the tolerances.
    assert "tuned: needle results reused from the cache" in err and len(list((tmp_path / "cache").iterdir())) == 2
    assert not (again / "base").exists() and (again / "tuned" / "needle").is_dir()
    assert report.load_results(again)["runs"]["base"]["needle"] == str(out / "base" / "needle")
    with pytest.raises(ValueError, match=r"its needle run used --seed 0, this guard asks for 1"):
        main(["eval", "guard", str(out / "base"), "tiny:llama", "--text", str(text), *FAST, "--seed", "1"])


def test_a_harmed_model_exits_1(text, saved, tmp_path, capsys):
    out = tmp_path / "harmed"
    rc = main(["eval", "guard", str(saved["base"]), str(saved["harmed"]), "--text", str(text), *FAST, "--no-cache",
               "--out", str(out)])
    line, _ = _last_line(capsys)
    assert rc == 1 and line.startswith("guard: HARM (needle "), line
    loss = report.load_results(out)["metrics"]["position-loss"]
    assert loss["harm"] and loss["low"] > 0.5 and loss["tuned"] > loss["base"]
    assert "beyond the 2.0% tolerance" in line and "**HARM**" in (out / "summary.md").read_text()


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    (root / "unreadable").mkdir()
    (root / "unreadable" / "notes.docx").write_text("not a docx")  # python-docx cannot open it
    (root / "short").mkdir()
    (root / "short" / "a.txt").write_text("Too short.")
    return {"missing": root / "missing", "unreadable": root / "unreadable", "short": root / "short"}


@pytest.mark.parametrize("case, model, says", [
    ("missing", "tiny:llama", "does not exist"),
    ("unreadable", "tiny:llama", "not a readable DOCX file"),
    ("short", "tiny:llama", "holds 3 tokens, the longest --lengths 128 needs about 192"),
    ("short", "./no-such-model", "no such model folder or file"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_rank(bad, case, model, says, monkeypatch, capsys):
    import longdoc.runtime.spawn

    monkeypatch.setattr(longdoc.runtime.spawn, "run_local", lambda *a, **k: pytest.fail("the ranks started"))
    lines = []
    for cp in ("1", "2"):
        rc = main(["eval", "guard", model, "tiny:llama", "--text", str(bad[case]), *FAST, "--cp", cp], catch=True)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("longdoc eval guard: error: "), err
        assert says in err[0]
        lines.append(err[0])
    assert lines[0] == lines[1]


def test_cli_unreadable_folder_with_cp2(bad, tmp_path):
    """As a user runs it: a subprocess, --cp 2; one line on stderr, exit 2, no traceback, no output folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run([sys.executable, "-m", "longdoc", "eval", "guard", "tiny:llama", "tiny:llama", "--text",
                           str(bad["unreadable"]), *FAST, "--cp", "2", "--out", str(tmp_path / "g")],
                          capture_output=True, text=True, timeout=300, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("longdoc eval guard: error: ") and "notes.docx" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "g").exists()
    assert proc.stdout == ""


@pytest.mark.slow
def test_cli_guard_with_cp2_spawns_the_ranks_once(text, tmp_path):
    """Both models in one start of 2 gloo ranks: a model against itself is NO HARM at cp=2 too."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    out = tmp_path / "g"
    proc = subprocess.run([sys.executable, "-m", "longdoc", "eval", "guard", "tiny:llama", "tiny:llama", "--text",
                           str(text), *FAST, "--no-cache", "--cp", "2", "--out", str(out)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("guard: NO HARM (needle ")
    assert report.load_results(out / "tuned" / "position-loss")["config"]["cp"] == 2
    assert report.load_results(out)["metrics"]["position-loss"]["delta"] == 0.0
