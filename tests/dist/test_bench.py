"""Benchmarks on real gloo ranks: the attention sweep (E and Z per length), and the planner's peak-memory estimate
within calibrate.TOLERANCE of the peak measured in real training runs."""

from __future__ import annotations

import json
import math

import pytest

from longdoc.bench import attention, calibrate


def test_attention_sweep_reports_e_and_z_per_length():
    res = attention.sweep([512, 1024], attention.AttentionBenchConfig(repeats=1), log=lambda *_: None)
    assert res["lengths"] == [512, 1024]
    for run in res["runs"]:
        assert all(math.isfinite(v) and v > 0 for v in run["ratios"].values())
    md = attention.sweep_markdown(res)
    assert "| 512 |" in md and "| 1,024 |" in md


def _check(rows: list[calibrate.Calibration]) -> None:
    print("\n" + calibrate.to_markdown(rows))
    bad = [c.to_dict() for c in rows if not c.ok]
    assert not bad, f"planner off by more than {calibrate.TOLERANCE:.0%}: {bad}"


def test_planner_predicts_peak_memory_of_real_runs_fast():
    """The default suite's share of the calibration: the tiny model at 2k tokens, cp=1 and cp=2."""
    _check(calibrate.calibrate(calibrate.QUICK_RUNS, log=print))


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)  # eight fresh training runs, the 135M ones at 4k-8k tokens
def test_planner_predicts_peak_memory_of_real_runs():
    """Acceptance: >= 6 CPU runs (tiny and 135M, cp 1/2, 4k-32k tokens) each within 15% of the measured peak."""
    rows = calibrate.calibrate(calibrate.DEFAULT_RUNS, log=print)
    assert len(rows) >= 6
    _check(rows)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_bench_quick_writes_json_markdown_and_plots(tmp_path):
    from longdoc.cli import main

    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- bench:start -->\nold\n<!-- bench:end -->\n")
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--out", str(out), "--readme", str(readme)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"attention", "train", "memory", "longest", "calibration"} <= set(result["sections"])
    assert len(list(out.glob("*.png"))) >= 5
    md = (out / "bench.md").read_text()
    assert "E (CP efficiency" not in md and "| E |" not in md  # the sweep table has E and Z columns
    assert " E | Z |" in md and "old" not in readme.read_text()
