"""`longdoc eval compare`: the paired bootstrap interval of each QA difference and the within-noise mark."""

from __future__ import annotations

import random

import numpy as np
import pytest

from longdoc.eval import compare, qa, report


def _rows(f1s: list[float], kinds: list[str]) -> list[dict]:
    return [{"doc_id": f"d{i % 3}", "qa_id": f"q{i}", "domain": "legal", "kind": k, "template": None, "depth": 0.5,
             "doc_tokens": 4096, "prompt_tokens": 4200, "question": "?", "answer": "a", "aliases": [],
             "prediction": "a", "em": float(f >= 1.0), "f1": f, "contains": float(f > 0), "nll": 2.0 - f,
             "answer_tokens": 1, "nll_per_token": 2.0 - f, "tf_em": 0.0} for i, (f, k) in enumerate(zip(f1s, kinds))]


def _run(tmp_path, name: str, rows: list[dict]):
    out = tmp_path / name / "qa"
    qa.write_report(out, {"task": "qa", "model": name, "summary": qa.summarize(rows), "rows": rows})
    return {"qa": out}


def test_paired_bootstrap_interval():
    rng = random.Random(0)
    a = [rng.random() for _ in range(200)]
    b = [x + 0.1 + rng.gauss(0, 0.05) for x in a]
    p = compare.paired_bootstrap(a, b)
    d = np.asarray(b) - np.asarray(a)
    assert p["n"] == 200 and p["delta"] == pytest.approx(d.mean())
    se = d.std(ddof=1) / np.sqrt(d.size)  # the normal-theory interval, which the bootstrap must approximate
    assert p["low"] == pytest.approx(d.mean() - 1.96 * se, abs=0.3 * se)
    assert p["high"] == pytest.approx(d.mean() + 1.96 * se, abs=0.3 * se)
    assert not p["noise"] and p["low"] > 0
    assert compare.paired_bootstrap(a, b) == p, "fixed seed: the same runs give the same interval"
    same = compare.paired_bootstrap(a, a)
    assert same["noise"] and same["low"] == same["high"] == 0.0
    # Pairing matters: one shared offset between the questions is noise without pairing, clear with it.
    assert compare.paired_bootstrap([0.0, 1.0] * 10, [0.05, 1.05] * 10)["noise"] is False
    with pytest.raises(ValueError, match="pair the same items"):
        compare.paired_bootstrap([1.0], [1.0, 2.0])


def test_compare_reports_intervals_and_marks_noise(tmp_path, capsys):
    kinds = ["lookup", "count"] * 20
    base = [0.0, 0.0, 0.5, 1.0] * 10
    # tuned: clearly better on lookup, the same on count (one question better, one worse)
    tuned = [1.0 if k == "lookup" else f for f, k in zip(base, kinds)]
    tuned[1], tuned[3] = 0.5, 0.5
    out = compare.write_comparison(_run(tmp_path, "base", _rows(base, kinds)),
                                   _run(tmp_path, "tuned", _rows(tuned, kinds)), ("base", "tuned"), tmp_path / "cmp")
    res = report.load_results(out)
    f1 = res["qa"]["paired"]["f1"]
    assert f1["n"] == 40 and f1["delta"] == pytest.approx(np.mean(tuned) - np.mean(base))
    assert f1["low"] <= f1["delta"] <= f1["high"] and not f1["noise"]
    assert res["qa"]["overall"]["f1"] == {"a": pytest.approx(np.mean(base)), "b": pytest.approx(np.mean(tuned))}
    by_kind = res["qa"]["by_kind"]
    assert not by_kind["lookup"]["f1_paired"]["noise"] and by_kind["lookup"]["f1_paired"]["n"] == 20
    assert by_kind["count"]["f1_paired"]["noise"] and by_kind["count"]["f1_paired"]["n"] == 20
    assert (out / "compare_qa_nll.png").stat().st_size > 1000
    md = (out / report.SUMMARY).read_text()
    assert "paired bootstrap" in md and "within noise" in md
    lines = compare.console_summary(res)
    f1_line = next(line for line in lines if line.startswith("qa F1:"))
    assert f"[{f1['low']:+.3f}, {f1['high']:+.3f}] over 40 questions" in f1_line and "within noise" not in f1_line
    tf_line = next(line for line in lines if line.startswith("qa TF-EM:"))
    assert "within noise" in tf_line  # 0 vs 0
