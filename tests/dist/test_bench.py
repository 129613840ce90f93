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
    assert "E ulysses" in md and "usp" not in res["runs"][0]["median_s"]  # 2 ranks: no proper usp factoring


def test_attention_bench_has_a_row_per_strategy_with_bytes_and_peak_memory():
    res = attention.run(attention.AttentionBenchConfig(seq_len=512, ranks=4, repeats=1, heads=4, kv_heads=2))
    rows = set(res["median_s"])
    assert {"zigzag/ring", "zigzag/allgather", "zigzag/ulysses", "zigzag/usp 2x2"} <= rows
    assert all(res["bytes_per_rank"][k] > 0 for k in rows if k != "single/sdpa")
    assert all(res["peak_mib_per_rank"][k] >= 0 for k in rows)
    # counted bytes: Ulysses moves less than the ring at 4 ranks (4 query / 2 K/V heads: q, k, v, o over 4 ranks)
    assert res["bytes_per_rank"]["zigzag/ulysses"] < res["bytes_per_rank"]["zigzag/ring"]
    md = attention.to_markdown(res)
    assert "| zigzag/usp 2x2 |" in md and "E_usp" in md


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

    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"attention", "train", "memory", "longest", "calibration"} <= set(result["sections"])
    assert len(list(out.glob("*.png"))) >= 5
    md = (out / "bench.md").read_text()
    assert "E (CP efficiency" not in md and "| E |" not in md  # the sweep table has E and Z columns
    assert " E | Z |" in md


@pytest.mark.slow
def test_hybrid_section_state_bytes_do_not_grow_with_the_sequence():
    from longdoc.bench import hybrid

    small = dict(repeats=1, layers=4, hidden=64, mamba_heads=8, state=16, chunk=32)
    a, b = (hybrid.run(hybrid.HybridBenchConfig(seq_len=n, **small)) for n in (256, 512))
    assert a["bytes_per_layer"]["state"] == b["bytes_per_layer"]["state"] > 0
    assert a["bytes_per_layer"]["halo"] == b["bytes_per_layer"]["halo"] > 0
    assert b["bytes_per_layer"]["ring attention"] == 2 * a["bytes_per_layer"]["ring attention"] > 0
    assert a["E"] > 0 and a["cp_peak_gib"] > 0 and a["single_peak_gib"] > 0
    md = hybrid.to_markdown(b)
    assert "| cp=2 |" in md and "| state |" in md and "E (one process / CP)" in md


def test_dsa_bench_runs_at_small_sizes():
    from longdoc.bench import dsa

    result = dsa.run(dsa.DsaBenchConfig(seq_len=256, index_topk=32, layers=1, repeats=1))
    assert set(result["median_s"]) == {"single/dsa", "single/dense", "cp/dsa", "cp/dense"}
    assert all(v > 0 for v in [*result["median_s"].values(), *result["peak_gib"].values()])
    assert "DSA speedup" in dsa.to_markdown(result)


@pytest.mark.slow  # a real training run per cell; the fast tier checks the planner against real runs (calibration)
def test_bench_longest_quick_journals_a_real_run_and_resumes_it(tmp_path):
    """One cell of `longdoc bench longest` (SmolLM2-135M's layer, FSDP + tiled MLP, cp=2, 1,024 tokens): the real
    trainer's peak beside the planner's, the journal, the plot; --resume then measures nothing."""
    from longdoc.cli import main

    out = tmp_path / "bench"
    args = ["bench", "longest", "--quick", "--models", "135m", "--out", str(out)]
    assert main(args) == 0
    (cell,) = json.loads((out / "longest.json").read_text())["cells"]
    assert cell["status"] == "measured" and cell["run"]["fsdp"] and cell["run"]["tiled_mlp"]
    assert 0.3 < cell["measured"]["peak_gib"] < 4 and cell["planner"]["longest_full_depth"] > 0
    assert (out / "longest_matrix.png").is_file() and "planner: longest at 30 layers" in (out / "bench.md").read_text()
    journal = (out / "longest.jsonl").read_text()
    assert main([*args, "--resume"]) == 0
    (again,) = json.loads((out / "longest.json").read_text())["cells"]
    assert again["measured"] == cell["measured"] and (out / "longest.jsonl").read_text() == journal
