"""The planner's CPU precision: the bf16-autocast device, its memory terms against what autocast really saves,
and the choice `longdoc plan --gpu cpu` and the benchmarks' runs make (what training picks on this machine)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import longdoc
from longdoc import models
from longdoc.bench import calibrate
from longdoc.bench.runs import TrainRun
from longdoc.plan import hardware, planner
from longdoc.plan.hardware import CPU_BF16_SPEEDUP, cpu_precision, device
from longdoc.plan.memory import Setup, estimate, layer_bytes_per_token
from longdoc.plan.planner import PlanRequest, plan
from longdoc.plan.shapes import model_shape, shape_from_config
from longdoc.plan.timing import estimate_time
from tests.support.saved_tensors import SMALL, saved_bytes_per_token


def _autocast_saved(model, n: int) -> float:
    """Total bytes one layer saves for backward under CPU bf16 autocast, for n tokens."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return saved_bytes_per_token(model, n=n) * n


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "stablelm", "gemma"])
def test_autocast_activation_formula_equals_what_the_model_saves(arch):
    model = models.tiny_model(arch, **SMALL)
    shape = shape_from_config(model.config)
    longdoc.patch(model, longdoc.ContextParallel())
    small, large = _autocast_saved(model, 256), _autocast_saved(model, 512)
    per_token, constant = (large - small) / 256, 2 * small - large
    # RoPE's cos/sin stay fp32 under autocast (one shared term of the plan)
    assert per_token == layer_bytes_per_token(shape, 2, autocast=True) + 2 * shape.rotary_dim * 4
    # the layer's bf16 weight copies, saved for its backward (the plan's "autocast bf16 weights saved");
    # Gemma's norms add their (1 + weight) once
    assert constant == pytest.approx(shape.params.layer * 2, abs=2 * shape.hidden * 4)
    assert per_token < layer_bytes_per_token(shape, 4) + 2 * shape.rotary_dim * 4  # but less than fp32


def test_autocast_activation_formula_with_lora():
    from peft import LoraConfig, get_peft_model

    model = models.tiny_model("llama", **SMALL)
    shape = shape_from_config(model.config)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    longdoc.patch(model, longdoc.ContextParallel())
    small, large = _autocast_saved(model, 256), _autocast_saved(model, 512)
    want = layer_bytes_per_token(shape, 2, lora=True, lora_rank=8, autocast=True) + 2 * shape.rotary_dim * 4
    assert (large - small) / 256 == want


def test_cpu_bf16_device_is_a_cpu_with_bf16_activations_and_fp32_weights():
    fp32, bf16 = device("cpu"), device("cpu", "bf16")
    assert device("cpu", "fp32") is fp32 and fp32.precision == "fp32" and not fp32.autocast
    assert not bf16.is_gpu and not bf16.gpu and bf16.autocast and bf16.precision == "bf16"
    assert (bf16.compute_bytes, bf16.weight_bytes) == (2, 4)
    assert bf16.peak_tflops == pytest.approx(fp32.peak_tflops * CPU_BF16_SPEEDUP)
    assert "bf16" in bf16.name and bf16.runtime_gib == fp32.runtime_gib
    assert device("h100").is_gpu and device("h100", "bf16") is device("h100")
    with pytest.raises(ValueError, match="--gpu cpu"):
        device("h100", "fp32")
    with pytest.raises(ValueError, match="fp32, bf16"):
        device("cpu", "fp16")


def test_bf16_cpu_setup_is_planned_as_a_cpu_run():
    shape = model_shape("SmolLM2-135M")
    base = Setup(shape=shape, seq_len=16384, cp=2, dp=1, device="cpu", checkpointing=False)
    bf16 = dataclasses.replace(base, precision="bf16")
    # a CPU rank under bf16 is still a CPU rank: DDP (no FSDP), per-tensor AdamW
    assert not bf16.uses_fsdp and bf16.uses_ddp and bf16.c == 2
    m32, m16 = estimate(base), estimate(bf16)
    assert "AdamW temporaries" in [t.label for t in m16.phases["optimizer"]]
    terms32, terms16 = ({t.label: t.bytes for t in m.phases["loss"]} for m in (m32, m16))
    assert terms16["weights"] == terms32["weights"] == shape.params.total * 4  # autocast keeps fp32 weights
    assert terms16["saved activations (30 layers)"] < 0.75 * terms32["saved activations (30 layers)"]
    forward16 = {t.label: t.bytes for t in m16.phases["forward"]}
    assert forward16["autocast bf16 weight cache"] == shape.params.matmul * 2
    assert "autocast bf16 weight cache" not in terms16  # left with autocast, before the loss backward
    assert terms16["autocast bf16 lm_head copy"] == shape.params.embed * 2  # tied: the embedding is the head
    lora = {t.label: t.bytes for t in estimate(dataclasses.replace(bf16, lora=True)).terms}
    assert lora["weights"] == shape.params.total * 4 + dataclasses.replace(bf16, lora=True).trainable * 4
    # compute-bound at cp=1: the measured bf16 speed-up, nothing else
    one32, one16 = (estimate_time(dataclasses.replace(s, cp=1)) for s in (base, bf16))
    assert one32.seconds["compute"] / one16.seconds["compute"] == pytest.approx(CPU_BF16_SPEEDUP)


def test_cpu_precision_follows_what_training_picks(tmp_path):
    native = tmp_path / "native"
    native.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16\n")
    emulated = tmp_path / "emulated"
    emulated.write_text("processor : 0\nflags : fpu sse avx512f\n")
    assert cpu_precision(str(native)) == "bf16" and cpu_precision(str(emulated)) == "fp32"
    assert cpu_precision(str(tmp_path / "missing")) == "fp32"


@pytest.mark.parametrize("here", ["bf16", "fp32"])
def test_plan_request_on_cpu_assumes_this_machines_precision(monkeypatch, here):
    monkeypatch.setattr(planner, "cpu_precision", lambda: here)
    req = PlanRequest(model="SmolLM2-135M", seq_len=16384, gpus=2, gpu="cpu", memory_gib=16.0)
    assert req.precision == here and req.dev.precision == here
    assert {c.setup.dev.precision for c in plan(req).candidates} == {here}
    other = "fp32" if here == "bf16" else "bf16"
    assert PlanRequest(model="SmolLM2-135M", seq_len=16384, gpus=2, gpu="cpu", precision=other).precision == other
    assert PlanRequest(model="Llama-3.1-8B", seq_len=8192, gpus=8).precision == "bf16"  # GPUs: bf16 everywhere


def test_a_cpu_plan_that_does_not_fit_still_suggests_a_gpu():
    for precision in ("fp32", "bf16"):  # the H200 plan is a bf16 one whatever the CPU's precision was
        p = plan(PlanRequest(model="SmolLM2-135M", seq_len=1 << 20, gpus=1, gpu="cpu", precision=precision,
                             checkpointing=True))
        assert p.best is None and any("H200" in s for s in p.suggestions), p.suggestions


def test_plan_request_precision_errors_name_the_fix():
    with pytest.raises(ValueError, match="fp32, bf16"):
        PlanRequest(model="SmolLM2-135M", seq_len=8192, gpus=2, gpu="cpu", precision="fp16")
    with pytest.raises(ValueError, match="CPU ranks only"):
        PlanRequest(model="Llama-3.1-8B", seq_len=8192, gpus=8, gpu="h100", precision="fp32")


def test_cli_names_the_precision_it_assumed(capsys):
    from longdoc.cli import main

    args = ["plan", "--model", "SmolLM2-135M", "--seq-len", "16384", "--gpus", "2", "--gpu", "cpu",
            "--memory-gib", "64", "--no-checkpointing", "--cp", "2"]
    peaks = {}
    for precision in ("fp32", "bf16"):
        assert main([*args, "--precision", precision]) == 0
        text = capsys.readouterr().out
        assert f"precision: {precision}" in text
        assert main([*args, "--precision", precision, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["precision"] == out["request"]["precision"] == precision
        peaks[precision] = out["recommended"]["peak_gib"]
    assert peaks["bf16"] < 0.8 * peaks["fp32"]  # without checkpointing the bf16 activations show
    assert main(args) == 0
    assert f"precision: {cpu_precision()}" in capsys.readouterr().out
    assert main([*args[:-2], "--gpu", "h100", "--precision", "fp32"]) == 2


def test_bench_runs_pin_the_precision_the_planner_predicts():
    assert TrainRun().precision == cpu_precision() == hardware.cpu_precision()
    for precision, setting in (("fp32", "no"), ("bf16", "bf16")):
        run = TrainRun(model="tiny", cp=2, seq_len=4096, precision=precision)
        assert run.recipe("/tmp/x")["train"]["mixed_precision"] == setting
        assert calibrate.setup_for(run).dev.precision == precision  # calibration compares like with like
    other = "fp32" if cpu_precision() == "bf16" else "bf16"
    assert TrainRun().label() == "tiny cp1 4k" and TrainRun(precision=other).label() == f"tiny cp1 4k {other}"
    with pytest.raises(ValueError, match="fp32, bf16"):
        TrainRun(precision="fp16")
    assert {r.precision for r in calibrate.DEFAULT_RUNS} == {cpu_precision(), "fp32"}


def test_calibration_table_names_each_runs_precision():
    from longdoc.bench.runs import RunResult

    rows = []
    for precision in ("bf16", "fp32"):
        run = TrainRun(precision=precision)
        rows.append(calibrate.compare(run, RunResult(run=run, peak_gib=1.3, rank_peaks_gib=[1.3], step_peaks_gib=[1.3],
                                                     step_s=[1.0], tokens_per_s=1.0)))
    md = calibrate.to_markdown(rows)
    assert "| bf16 |" in md and "| fp32 |" in md
    assert rows[0].predicted_gib != rows[1].predicted_gib  # each predicted in its own precision
    assert [r.to_dict()["precision"] for r in rows] == ["bf16", "fp32"]
