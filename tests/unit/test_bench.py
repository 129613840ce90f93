"""Benchmark plumbing without processes: reports, plots, publishing into the docs, CPU run of the CUDA kernel
section."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from longdoc.bench import calibrate, gpu, plots, suite
from longdoc.bench.runs import TrainRun
from longdoc.train.metrics import return_freed_memory


def _fake_result(load: float = 0.1) -> dict:
    att_run = {"median_s": {"single/sdpa": 1.0, "zigzag/ring": 1.05, "contiguous/ring": 1.5, "zigzag/allgather": 1.1,
                            "contiguous/allgather": 1.6},
               "ratios": {"E": 0.95, "Z": 1.43, "ring_vs_allgather": 1.05}}
    row = {"run": "tiny cp1 4k", "cp": 1, "seq_len": 4096, "model": "tiny", "checkpointing": True, "lora": False,
           "peak_gib": 1.30, "predicted_gib": 1.35, "error": 0.04, "tokens_per_s": 900.0, "step_s": [5.0, 4.5],
           "rank_peaks_gib": [1.3], "threads_per_rank": 2}
    row2 = row | {"cp": 2, "run": "tiny cp2 4k", "peak_gib": 1.0, "predicted_gib": 1.02, "threads_per_rank": 1}
    return {
        "machine": {"cpu": "Test CPU", "cpus": 2, "memory_gib": 23.0, "torch": "2.13.0", "python": "3.11"},
        "started": "2026-01-01T00:00:00", "finished": "2026-01-01T01:00:00", "load_start": load, "load_end": load,
        "plots": [],
        "sections": {
            "attention": {"config": dataclasses.asdict(suite.AttentionBenchConfig()), "lengths": [4096],
                          "runs": [att_run]},
            "train": [row, row2],
            "memory": {"run": "tiny cp1 16k noAC", "rows": [row | {"predicted_fixed_gib": 0.6,
                                                                    "predicted_scaling_gib": 0.7},
                                                             row2 | {"predicted_fixed_gib": 0.6,
                                                                     "predicted_scaling_gib": 0.4}]},
            "longest": {"cap_gib": 2.0, "run": "tiny cp1 4k noAC", "step": 4096,
                        "rows": [{"cp": 1, "predicted_longest": 16384, "measured_longest": 16384, "first_over": 20480,
                                  "probes": [row | {"seq_len": 16384}]}]},
            "calibration": [{"run": "tiny cp1 4k", "predicted_gib": 1.35, "measured_gib": 1.30, "error": 0.04,
                             "within_tolerance": True}],
        },
    }


def test_markdown_report_has_every_section_and_flags_a_loaded_machine():
    md = suite.to_markdown(_fake_result())
    for title in ("CP efficiency", "cp=1 vs cp=2", "vs cp", "memory cap", "Planner vs measured"):
        assert title in md
    assert "| 4,096 |" in md and "0.950" in md and "1.430" in md  # E and Z in the attention table
    assert "Other processes used the CPU" not in md
    assert "Other processes used the CPU (load average 4.0 at start)" in suite.to_markdown(_fake_result(load=4.0))
    # per-section CPU of other processes, when measured, decides (the load average counts our own ranks)
    quiet = _fake_result(load=4.0) | {"others_cores": {"attention": 0.01, "train": 0.02}}
    assert "Nothing else ran" in suite.to_markdown(quiet)
    busy = _fake_result() | {"others_cores": {"attention": 0.01, "train": 0.9}}
    assert "**Other processes used the CPU during train (0.90 cores)**" in suite.to_markdown(busy)


def test_cpu_of_other_processes_excludes_our_own():
    before = suite._cpu_seconds()
    start, cpu_start = time.perf_counter(), time.process_time()
    while time.process_time() - cpu_start < 0.5:  # burn 0.5 s of our own CPU (however loaded the machine)
        pass
    after = suite._cpu_seconds()
    own = after[1] - before[1]
    assert own >= 0.45  # our CPU seconds saw the loop, so it is subtracted from the machine's busy time
    assert after[0] - before[0] >= own - 0.05  # and the machine's busy time contains it
    assert suite._others_cores(before, time.perf_counter() - start) >= 0.0


def test_plots_are_written(tmp_path):
    r = _fake_result()["sections"]
    paths = [plots.attention(r["attention"], tmp_path), plots.throughput(r["train"], tmp_path),
             plots.memory(r["memory"], tmp_path), plots.calibration(r["calibration"], tmp_path, 0.15)]
    for p in paths:
        assert p.is_file() and p.read_bytes()[:4] == b"\x89PNG"


def test_publish_copies_the_run_into_the_docs_folder_and_keeps_other_files(tmp_path):
    run_dir, docs = tmp_path / "run", tmp_path / "docs-bench"
    res = _fake_result()
    run_dir.mkdir()
    docs.mkdir()
    res["plots"] = [str(plots.attention(res["sections"]["attention"], run_dir))]
    (docs / "patterns.json").write_text("{}")  # a section result published on its own: kept
    (docs / "bench.json").write_text('{"old": true}')
    files = suite.publish(res, docs)
    assert sorted(p.name for p in files) == ["attention.png", "bench.json"]
    published = json.loads((docs / "bench.json").read_text())
    assert published["sections"] == json.loads(json.dumps(res["sections"], default=str)) and "old" not in published
    assert published["plots"] == [str(docs / "attention.png")]
    assert (docs / "attention.png").read_bytes() == (run_dir / "attention.png").read_bytes()
    assert (docs / "patterns.json").read_text() == "{}"


def test_publish_refuses_a_partial_or_quick_run_before_running(tmp_path, capsys):
    from longdoc.cli import main

    for argv in (["bench", "--quick"], ["bench", "memory"]):
        assert main([*argv, "--out", str(tmp_path / "run"), "--publish", str(tmp_path / "docs")]) == 2
        assert "--publish takes a full run" in capsys.readouterr().out
    assert not (tmp_path / "run").exists() and not (tmp_path / "docs").exists()


def test_kernel_section_runs_on_cpu_at_toy_size():
    cfg = gpu.KernelBenchConfig(lengths=(128,), ranks=(2, 4), heads=4, kv_heads=2, head_dim=16, dtype="float32",
                                repeats=1, device="cpu")
    res = gpu.run(cfg, log=lambda *_: None)
    assert [r["variant"] for r in res["rows"]] == ["full SDPA", "kernel cpu_flash, 1 block", "2 ranks (per rank)",
                                                   "4 ranks (per rank)"]
    assert all(r["seconds"] > 0 and r["tflops"] > 0 for r in res["rows"])
    assert "| 128 |" in gpu.to_markdown(res)


@pytest.mark.gpu
def test_kernel_section_on_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = gpu.KernelBenchConfig(lengths=(4096,), ranks=(2, 4), repeats=2)
    res = gpu.run(cfg, log=print)
    assert len(res["rows"]) == 4 and all(r["tflops"] > 1 for r in res["rows"])
    print(gpu.to_markdown(res))


def test_simulated_ranks_compute_the_real_attention():
    # The ring with local copies instead of messages is the real algorithm: rank outputs == full attention.
    import torch
    import torch.nn.functional as F

    from longdoc.parallel import kernels
    from longdoc.parallel import layout as layouts
    from longdoc.parallel.ring import ring_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kernel = kernels.KERNELS["math"]
    size = 4
    kv = [torch.stack([layouts.shard(k, 2, r, size, "zigzag"), layouts.shard(v, 2, r, size, "zigzag")])
          for r in range(size)]
    for r in range(size):
        out, _ = ring_forward(layouts.shard(q, 2, r, size, "zigzag"), kv[r][0], kv[r][1], gpu._LocalRing(r, size, kv),
                              "zigzag", True, 16**-0.5, kernel)
        torch.testing.assert_close(out, layouts.shard(ref, 2, r, size, "zigzag"))


def test_calibration_predictions_cover_the_acceptance_set():
    runs = calibrate.DEFAULT_RUNS
    assert len(runs) >= 6
    assert {r.model for r in runs} == {"tiny", "135m"} and {r.cp for r in runs} == {1, 2}
    assert min(r.seq_len for r in runs) >= 4096 and max(r.seq_len for r in runs) <= 32768
    for r in runs:
        est = calibrate.predict(r)
        assert 0.5 < est.total_gib < 8.0, (r.label(), est.total_gib)
        assert est.setup.device == "cpu" and est.setup.uses_ddp and not est.setup.uses_fsdp  # launched: DDP
    assert {calibrate.predict(r).peak_phase for r in runs} == {"loss", "backward"}


def test_train_run_recipe_and_labels():
    r = TrainRun(model="135m", cp=2, seq_len=16384, lora=True, checkpointing=False)
    recipe = r.recipe("/tmp/x")
    assert recipe["parallelism"]["cp_size"] == 2 and recipe["lora"]["enabled"]
    assert recipe["model"]["rope_type"] == "yarn"
    assert recipe["model"]["rope_factor"] == 2.0 and recipe["train"]["activation_checkpointing"] is False
    assert r.label() == "135m cp2 16k noAC LoRA" and r.rank_threads == 1
    with pytest.raises(ValueError, match="tiny"):
        TrainRun(model="7b")
    assert isinstance(return_freed_memory(), bool)


def test_cli_rejects_unknown_sections(capsys):
    from longdoc.cli import main

    assert main(["bench", "nonsense"]) == 2
    assert "choose among" in capsys.readouterr().out


def test_mix_step_bench_rows_match_the_training_weights():
    """The mix-step bench's rows: answers only; the drawn mix with n document targets weighted N/n (sum kept);
    every document token in the full mix."""
    import torch

    from longdoc.bench.mix_step import MixStepBenchConfig, _targets

    cfg = MixStepBenchConfig(seq_len=512, answers=40, context_positions=32, autocast=False)
    ids = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(0))
    a, drawn, full = (_targets(cfg, ids, v) for v in ("answers", "mix-drawn", "mix-all"))
    assert int((a["labels"] != -100).sum()) == 40 and "kl_weights" not in a
    doc = 512 - 40 - 1  # document positions that predict a document token
    assert int((drawn["labels"] != -100).sum()) == 40 + 32 and int((full["labels"] != -100).sum()) == 40 + doc
    for t in (drawn, full):
        assert float(t["loss_weights"].sum()) == pytest.approx(40 + 0.1 * doc)
        assert float(t["kl_weights"].sum()) == pytest.approx(doc) and int(t["num_kl_tokens"]) == doc
        assert bool((t["labels"][0, :-1][t["labels"][0, :-1] != -100] == ids[0, 1:][t["labels"][0, :-1] != -100]).all())


def test_dpo_step_bench_layouts_predict_the_same_answer_tokens():
    """The DPO-step bench's two layouts ask the same question of the model: the same answer tokens, each predicted
    from the same context (the prompt, then the answer so far), so their log-probabilities agree and only the cost
    differs; the shared layout's rejected tokens start from the prompt's last position."""
    import torch

    import longdoc
    from longdoc.bench.dpo_step import DpoStepBenchConfig, _shared, _two_sequence

    cfg = DpoStepBenchConfig(prompt=64, answer=5, autocast=False)
    ids = torch.randint(0, 1000, (64 + 10,), generator=torch.Generator().manual_seed(0))
    (two_batch, two), (shared_batch, shared) = _two_sequence(cfg, ids), _shared(cfg, ids, longdoc.ContextParallel())
    assert two_batch["input_ids"].shape == (2, 69) and shared_batch["input_ids"].shape == (1, 74)
    for t in (two, shared):
        assert t.token.tolist() == ids[64:].tolist() and t.slot.tolist() == [0] * 5 + [1] * 5
        assert t.lengths.flatten().tolist() == [5.0, 5.0]
    assert two.logit.tolist() == [63, 64, 65, 66, 67] + [69 + 63, 69 + 64, 69 + 65, 69 + 66, 69 + 67]
    assert shared.logit.tolist() == [63, 64, 65, 66, 67] + [63, 69, 70, 71, 72]
