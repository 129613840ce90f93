"""`make gpu-check` dry-run on the CPU: the script runs end to end, the parts that need CUDA are skipped by name, the
step runs (tiny, on the CPU) with the checkpoint offload off and on, and the 1B-class length comes from the planner."""

from __future__ import annotations

import json
from pathlib import Path

from longdoc.bench import gpucheck

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_writes_every_part_and_skips_the_cuda_ones_by_name(tmp_path):
    out = tmp_path / "gpu-check.json"
    result = gpucheck.check(out, dry_run=True)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["tests"] == {"status": "skipped", "why": "no CUDA device: pytest -m gpu needs one"}
    assert result["kernels"]["status"] == "skipped" and "CUDA" in result["kernels"]["why"]
    step = result["step"]
    assert step["status"] == "ran" and step["predicted_peak_gib"] > 0
    off, on = step["runs"]
    assert (off["offload"], on["offload"]) == (False, True)
    assert off["loss"] == on["loss"]  # the offload moves tensors, never changes the arithmetic


def test_without_a_device_the_real_check_refuses_in_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert gpucheck.main(["--out", "/dev/null"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_the_1b_class_step_length_is_the_planners_longest_under_the_cap():
    length = gpucheck.longest_length(gpucheck.MODEL, "cuda", gpucheck.MEMORY_CAP_GIB)
    assert 32_768 <= length <= 262_144  # full fine-tuning of 1.2B parameters on an H200, capped at 40 GiB


def test_make_has_the_target():
    assert "gpu-check:" in (ROOT / "Makefile").read_text()
