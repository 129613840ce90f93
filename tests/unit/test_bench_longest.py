"""`longdoc bench longest` without processes: the matrix's cells (probes under the cap, combinations left out with
their reason), the planner's longest, the journal and --resume, the report, the plot, the docs block, the options."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from longdoc.bench import longest, plots, suite
from longdoc.bench.calibrate import predict, run_shape
from longdoc.bench.runs import RunResult, TrainRun

CFG = longest.LongestConfig(precision="bf16")  # pinned: the cells must not depend on this machine's CPU


class Killed(BaseException):
    """A run killed mid-matrix (not an Exception: a cell's failure is recorded, a kill stops the run)."""


def _fake(factor: float = 1.0, fail=lambda run: False, kill_after: int | None = None):
    """A measure function: the planner's prediction times `factor` as the peak, no processes."""
    calls: list[TrainRun] = []

    def measure(run: TrainRun) -> RunResult:
        if kill_after is not None and len(calls) >= kill_after:
            raise Killed
        calls.append(run)
        if fail(run):
            raise AssertionError("distributed run failed:\n--- rank 0 ---\nTraceback ...\nRuntimeError: out of memory")
        peak = predict(run).total_gib * factor
        return RunResult(run=run, peak_gib=peak, rank_peaks_gib=[peak] * run.cp, step_peaks_gib=[peak * 0.9, peak],
                         step_s=[1.0, 1.0], tokens_per_s=run.seq_len / 1.0)

    measure.calls = calls
    return measure


def test_the_default_matrix_plans_every_cell_or_says_why_not():
    cells = longest.plan_cells(CFG)
    assert len(cells) == 3 * 3 * 4  # models x cp x features
    by = {(c.model, c.cp, c.feature): c for c in cells}
    for cp in (1, 2, 4):
        # FSDP with LoRA: the planner's own refusal, word for word
        assert by["135m-lora", cp, "fsdp"].run is None and "--fsdp shards full fine-tuning" in by["135m-lora", cp,
                                                                                                   "fsdp"].note
        # all on with LoRA is the tiled run: left out, not measured twice
        assert by["135m-lora", cp, "all"].run is None and "the same run as '+ tiled MLP'" in by["135m-lora", cp,
                                                                                                 "all"].note
        full = by["135m", cp, "all"].run
        assert full.fsdp and full.tiled_mlp and not full.offload and full.layers == 1
        assert by["hybrid", cp, "baseline"].run.layers == 2  # a Mamba2 and an attention layer
    measured = [c for c in cells if c.run is not None]
    assert len(measured) == 3 * 4 + 3 * 2 + 3 * 4
    for cell in measured:
        run = cell.run
        assert run.seq_len == CFG.probe * run.cp or "probe lowered to" in cell.note
        assert run.steps == 2 and run.precision == "bf16"
        assert run.loss_chunk == 448  # sized from the 49k vocabulary, as `longdoc train` does
        assert predict(run).total_gib <= longest.PROBE_SHARE * CFG.cap_gib


def test_the_probe_is_halved_under_the_cap_and_a_cell_that_cannot_fit_is_left_out():
    cfg = dataclasses.replace(CFG, models=("135m",), cps=(1,), features=("baseline",), probe=32768, cap_gib=2.5)
    (cell,) = longest.plan_cells(cfg)
    assert cell.run is not None and cell.run.seq_len < 32768 and "probe lowered to" in cell.note
    assert predict(cell.run).total_gib <= longest.PROBE_SHARE * 2.5
    assert predict(dataclasses.replace(cell.run, seq_len=2 * cell.run.seq_len)).total_gib > longest.PROBE_SHARE * 2.5
    (cell,) = longest.plan_cells(dataclasses.replace(cfg, cap_gib=0.5))
    assert cell.run is None and cell.note.startswith("left out: the planner puts even 256 tokens per rank")


def test_the_planners_longest_brackets_the_cap_at_full_depth():
    run = TrainRun(model="135m", cp=2, seq_len=4096, layers=1, fsdp=True, tiled_mlp=True, precision="bf16")
    n = longest.planner_longest(dataclasses.replace(run, layers=None), 4.0)
    assert n > 0 and n % longest.STEP == 0
    full = dataclasses.replace(run, layers=None)
    assert predict(dataclasses.replace(full, seq_len=n)).total_gib <= 4.0
    assert predict(dataclasses.replace(full, seq_len=n + longest.STEP)).total_gib > 4.0
    assert longest.planner_longest(dataclasses.replace(full, cp=4), 4.0) > n  # fewer tokens per rank buy length
    assert longest.planner_longest(full, 0.1) == 0
    part = longest.planner_part(run, 4.0)
    assert part["full_layers"] == 30 and part["longest_full_depth"] == n


def test_the_hybrid_run_builds_granite_4_h_layers_the_planner_reads():
    run = TrainRun(model="hybrid", cp=2, seq_len=4096, layers=2)
    model = run.recipe("/tmp/x")["model"]
    assert model["name"] == "tiny:granitemoehybrid"
    assert model["overrides"]["layer_types"] == ["mamba", "attention"] and model["overrides"]["num_hidden_layers"] == 2
    shape = run_shape(run)
    assert shape.layers == 2 and shape.mixers and not shape.moe and shape.intermediate == 1536
    assert run_shape(dataclasses.replace(run, layers=None)).layers == 30
    assert TrainRun(model="hybrid").overrides()["layer_types"].count("attention") == 3  # 1 in 10, as Granite 4.0-H
    with pytest.raises(ValueError, match="at least 2 layers"):
        TrainRun(model="hybrid", layers=1)


def _small(**kw) -> longest.LongestConfig:
    return dataclasses.replace(CFG, models=("135m", "135m-lora"), cps=(1, 2), features=("baseline", "fsdp", "all"),
                               probe=1024, **kw)


def test_a_run_journals_each_cell_and_reports_measured_and_planner_apart(tmp_path):
    def fail(run):  # the full fine-tuning baseline at cp=2: recorded as failed, the matrix goes on
        return run.cp == 2 and not (run.lora or run.fsdp)

    res = longest.run(_small(), tmp_path, log=lambda *_: None, measure=_fake(fail=fail))
    cells = res["cells"]
    assert len(cells) == 2 * 2 * 3
    statuses = [c["status"] for c in cells]
    # LoRA: FSDP refused; all on is the tiled MLP alone, measured (no + tiled MLP cell here to repeat)
    assert statuses.count("measured") == 9 and statuses.count("failed") == 1 and statuses.count("skipped") == 2
    lora_all = next(c for c in cells if (c["model"], c["feature"]) == ("135m-lora", "all"))
    assert lora_all["run"]["tiled_mlp"] and not lora_all["run"]["fsdp"]
    assert lora_all["note"].startswith("without FSDP, which the planner refuses")
    failed = next(c for c in cells if c["status"] == "failed")
    assert failed["error"] == "RuntimeError: out of memory" and "planner" in failed  # the planner's part still there
    for c in cells:
        if c["status"] == "measured":
            assert c["planner"]["error"] == pytest.approx(0.0, abs=1e-12) and c["planner"]["within_tolerance"]
            assert c["before"]["load"] and c["after"]["load"] and c["wall_s"] >= 0
    lines = (tmp_path / longest.JOURNAL).read_text().splitlines()
    assert [json.loads(x) for x in lines] == cells
    assert res["offload_moves_memory"] is False  # on a CPU the host is the device

    md = longest.to_markdown(res)
    assert "**Measured**" in md and "**Planner**" in md and "planner: longest at 30 layers" in md
    assert "#### SmolLM2-135M, full fine-tuning" in md and "#### SmolLM2-135M, LoRA" in md
    assert "failed: RuntimeError: out of memory" in md
    assert "cp=1 + FSDP: left out: the planner refuses it (--fsdp shards" in md
    assert "Checkpoint offload: left out of the features; on this CPU the planner's estimate of every run is the same" \
        in md
    assert "cp=2 " in md and "(FSDP + tiled MLP)" in md  # the best features per cp, in the summary
    assert "x |" in md  # vs baseline


def test_an_error_beyond_5_percent_is_flagged(tmp_path):
    res = longest.run(dataclasses.replace(_small(), models=("135m",), cps=(2,), features=("all",)), tmp_path,
                      log=lambda *_: None, measure=_fake(factor=0.9))
    (cell,) = res["cells"]
    assert cell["planner"]["error"] == pytest.approx(1 / 0.9 - 1) and not cell["planner"]["within_tolerance"]
    md = longest.to_markdown(res)
    assert "**+11.1%**" in md and f"1 with the planner beyond 5%: {cell['run']['label']}" in md


def test_resume_measures_only_the_cells_a_killed_run_left(tmp_path):
    cfg = _small()
    with pytest.raises(Killed):
        longest.run(cfg, tmp_path, log=lambda *_: None, measure=_fake(kill_after=2))
    journal = [json.loads(x) for x in (tmp_path / longest.JOURNAL).read_text().splitlines()]
    assert sum(r["status"] == "measured" for r in journal) == 2  # what finished before the kill is kept

    again = _fake()
    res = longest.run(cfg, tmp_path, log=lambda *_: None, resume=True, measure=again)
    assert len(again.calls) == 10 - 2
    assert [c["run"]["label"] for c in res["cells"] if c["status"] == "measured"][:2] == \
        [r["run"]["label"] for r in journal if r["status"] == "measured"]
    # without --resume everything is measured afresh
    fresh = _fake()
    longest.run(cfg, tmp_path, log=lambda *_: None, measure=fresh)
    assert len(fresh.calls) == 10


def test_resume_keeps_other_cells_and_remeasures_a_changed_probe(tmp_path):
    one = dataclasses.replace(_small(), models=("135m",), cps=(1,), features=("baseline",))
    longest.run(one, tmp_path, log=lambda *_: None, measure=_fake())
    other = dataclasses.replace(one, cps=(2,))
    calls = _fake()
    longest.run(other, tmp_path, log=lambda *_: None, resume=True, measure=calls)
    assert len(calls.calls) == 1
    journal = [json.loads(x) for x in (tmp_path / longest.JOURNAL).read_text().splitlines()]
    assert [r["cp"] for r in journal] == [1, 2]  # the cp=1 cell stays in the journal
    probe = _fake()
    longest.run(dataclasses.replace(other, probe=2048), tmp_path, log=lambda *_: None, resume=True, measure=probe)
    assert len(probe.calls) == 1  # another probe length is another run


def test_journal_only_assembles_partial_runs_without_measuring(tmp_path):
    one = dataclasses.replace(_small(), models=("135m",), cps=(1,), features=("baseline",))
    longest.run(one, tmp_path, log=lambda *_: None, measure=_fake())
    longest.run(dataclasses.replace(one, cps=(2,)), tmp_path, log=lambda *_: None, resume=True, measure=_fake())
    whole = dataclasses.replace(one, cps=(1, 2, 4))
    none = _fake()
    res = longest.run(whole, tmp_path, log=lambda *_: None, resume=True, measure=none, journal_only=True)
    assert none.calls == []
    assert {c["cp"]: c["status"] for c in res["cells"]} == {1: "measured", 2: "measured", 4: "skipped"}
    assert "not measured" in next(c["note"] for c in res["cells"] if c["cp"] == 4)
    assert "not measured" in longest.to_markdown(res)
    with pytest.raises(ValueError, match="needs --resume"):
        longest.run(whole, tmp_path, log=lambda *_: None, measure=none, journal_only=True)


def test_config_checks_name_the_valid_choices():
    with pytest.raises(ValueError, match="models must be among 135m, 135m-lora, hybrid, got 7b"):
        dataclasses.replace(CFG, models=("7b",))
    with pytest.raises(ValueError, match="features must be among baseline"):
        dataclasses.replace(CFG, features=("fast",))
    with pytest.raises(ValueError, match="probe >= 256"):
        dataclasses.replace(CFG, probe=100)


def _result(tmp_path) -> dict:
    cfg = dataclasses.replace(CFG, models=("135m", "hybrid"), cps=(1, 2), features=("baseline", "all"), probe=1024)
    return longest.run(cfg, tmp_path, log=lambda *_: None, measure=_fake(factor=0.97))


def test_the_plot_and_the_suite_report(tmp_path):
    res = _result(tmp_path)
    png = plots.longest_matrix(res, tmp_path)
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    report = {"machine": {"cpu": "Test CPU", "cpus": 2, "torch": "2.13.0", "python": "3.11"}, "started": "x",
              "load_start": 0.1, "load_end": 0.1, "sections": {"longest": res | {"machine": {"cpus": 2}}}}
    md = suite.to_markdown(report)
    assert "#### Longest sequence under a per-process memory cap" in md and "#### hybrid (SmolLM2-135M's width" in md
    notes = {n for c in res["cells"] for n in c["planner"]["notes"]}
    assert all(f"- planner: {n}" in md for n in notes)  # the planner's own caveats, beside its numbers


def _docgen():
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("docgen", root / "docs" / "hooks" / "docgen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_block_renders_the_newest_published_matrix_or_says_it_is_not_measured(tmp_path, monkeypatch):
    docgen = _docgen()
    monkeypatch.setattr(docgen, "_bench_files", lambda: [])
    assert docgen.longest_matrix().startswith("Not measured yet")
    res = _result(tmp_path)
    older = res | {"started": "2026-01-01T00:00:00"}
    files = [(tmp_path / "longest-matrix-2026-01-01.json", older), (tmp_path / "longest-matrix-2026-12-08.json",
                                                                     res | {"started": "2026-12-08T00:00:00"})]
    (tmp_path / "longest-matrix-2026-12-08.png").write_bytes(b"\x89PNG")
    monkeypatch.setattr(docgen, "_bench_files", lambda: files)
    block = docgen.longest_matrix()
    assert block.startswith("From docs/bench/longest-matrix-2026-12-08.json:")
    assert "planner: longest at 30 layers" in block and "(bench/longest-matrix-2026-12-08.png)" in block
    page = docgen.performance()
    assert "docs/bench/longest-matrix-2026-12-08.json" in page and "no renderer" not in page


def test_the_command_line_options_reach_the_section(monkeypatch, tmp_path):
    from longdoc.cli import main

    seen = {}

    def fake_run(cfg, log=print):
        seen["cfg"] = cfg
        return {"machine": {"cpus": 2}, "sections": {}, "plots": [], "started": "x"}

    monkeypatch.setattr(suite, "run", fake_run)
    monkeypatch.setattr(suite, "to_markdown", lambda result: "")
    assert main(["bench", "longest", "--cp", "2,4", "--models", "135m,hybrid", "--features", "baseline,all",
                 "--layers", "2", "--probe", "4k", "--cap-gib", "3", "--precision", "fp32", "--resume",
                 "--out", str(tmp_path)]) == 0
    cfg = seen["cfg"]
    assert cfg.sections == ("longest",) and cfg.resume
    assert cfg.longest == longest.LongestConfig(cap_gib=3.0, cps=(2, 4), models=("135m", "hybrid"),
                                                features=("baseline", "all"), layers=2, probe=4096, precision="fp32")
    main(["bench", "longest", "--quick", "--out", str(tmp_path)])
    assert seen["cfg"].longest == longest.QUICK
    with pytest.raises(ValueError, match="models must be among"):
        main(["bench", "longest", "--models", "7b", "--out", str(tmp_path)])
