"""The checks only a CUDA device can make: the GPU tests, the CUDA kernels' speed, the planner's memory on a real step.

Three parts, each recorded in the JSON file as ran / passed / failed, or skipped with the reason:
  1. tests: `pytest -m gpu`, the tests that need CUDA: the bf16/fp32 CUDA kernel path against the float64
     reference, the DSA indexer's top-k selection on CUDA (the same keys at every tile shape and rank split), the
     checkpoint offload's pinned host memory and lower peak, and `longdoc bench gpu` on a device; the counts from
     pytest's closing line (it gets half of --budget-s, default TIME_BUDGET_S);
  2. kernels: `longdoc bench gpu` at 8k and 32k tokens, 2 and 4 ranks: TFLOP/s of longdoc's block kernels and of a
     zigzag ring's blocks against one flash-attention call over the whole sequence;
  3. step: one full-fine-tuning step as `longdoc train` takes it at cp=1 (AdamW, fp32 master weights, bf16
     autocast, activation checkpointing, chunked loss) of a 1B-class model (Llama-3.2-1B's published shape, random
     weights, no download) at the longest length the planner fits under MEMORY_CAP_GIB, with the checkpoint offload
     off and on: the measured peak (torch.cuda.max_memory_allocated) beside the planner's prediction for the same
     setup, their ratio, and the step's seconds; an out-of-memory step is recorded as such (the planner was wrong).
The exit status is 1 when a part failed. docgen publishes the file on the performance page.

    python -m longdoc.bench.gpucheck --out docs/bench/gpu-check.json     # on a GPU machine (make gpu-check)
    python -m longdoc.bench.gpucheck --dry-run --out /tmp/gpu-check.json  # anywhere: CUDA parts skipped by name

The dry run runs the same code with the CUDA parts skipped and the step on the CPU with a tiny config, so the CPU
tests prove the script end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODEL = "Llama-3.2-1B"  # data/configs: the published shape, built with random weights
MEMORY_CAP_GIB = 40.0  # the planner's longest length under this cap keeps the step well inside the time budget
TIME_BUDGET_S = 480


def _skipped(why: str) -> dict[str, Any]:
    return {"status": "skipped", "why": why}


def run_tests(cuda: bool, timeout_s: int) -> dict[str, Any]:
    """`pytest -m gpu`: the counts from its closing line."""
    if not cuda:
        return _skipped("no CUDA device: pytest -m gpu needs one")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "why": f"pytest -m gpu ran past {timeout_s} s"}
    tail = (done.stdout + done.stderr).strip().splitlines()[-30:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", "\n".join(tail[-3:]))}
    return {"status": "passed" if done.returncode == 0 else "failed", "counts": counts, "tail": tail}


def run_kernels(cuda: bool) -> dict[str, Any]:
    """`longdoc bench gpu` at short lengths."""
    if not cuda:
        return _skipped("no CUDA device: the kernel benchmark measures CUDA kernels")
    from longdoc.bench import gpu

    cfg = gpu.KernelBenchConfig(lengths=(8192, 32768), ranks=(2, 4), repeats=3)
    return {"status": "ran", "result": gpu.run(cfg, print)}


def _plan(model: str, seq_len: int, device: str, cap_gib: float | None, offload: bool = False):
    """The planner's prediction for the step `train_step` takes (no tiled MLP; the offload as run)."""
    from longdoc.plan.planner import PlanRequest, plan

    gpu = "h200" if device == "cuda" else "cpu"
    return plan(PlanRequest(model=model, seq_len=seq_len, gpus=1, gpu=gpu, cp=1, checkpointing=True,
                            memory_gib=cap_gib, offload=offload, tiled_mlp=False))


def longest_length(model: str, device: str, cap_gib: float | None) -> int:
    """The planner's longest trainable length (full fine-tuning, one device, checkpointing) under the cap."""
    from longdoc.plan.planner import PlanRequest, longest_fitting

    gpu = "h200" if device == "cuda" else "cpu"
    return longest_fitting(PlanRequest(model=model, seq_len=1 << 21, gpus=1, gpu=gpu, cp=1, checkpointing=True,
                                       memory_gib=cap_gib, offload=False, tiled_mlp=False))


def train_step(config: Any, seq_len: int, device: str, offload: bool) -> dict[str, Any]:
    """One full-fine-tuning step as `longdoc train` takes it at cp=1 (AdamW, fp32 weights, bf16 autocast,
    checkpointing, chunked loss): step seconds, loss and the peak of allocated memory (CUDA) in GiB."""
    from transformers import AutoModelForCausalLM

    import longdoc
    from longdoc.train.loss import LossModel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}) \
        if hasattr(model, "activation_checkpointing_enable") else \
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        from longdoc.hf.offload import offload_checkpoints

        offload_checkpoints(model)
    cp = longdoc.ContextParallel()
    longdoc.patch(model, cp)
    model.train()
    loss_model = LossModel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device == "cuda")
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    local = cp.shard_batch({"input_ids": ids, "labels": ids})
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    autocast = torch.autocast(device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    with autocast:
        share, _ = loss_model(local["input_ids"].to(device), local["position_ids"].to(device),
                              local["shift_labels"].to(device), num_loss_tokens=local["num_items_in_batch"])
    share.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    out = {"seq_len": seq_len, "offload": offload, "step_s": time.perf_counter() - start, "loss": float(share.detach())}
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, loss_model
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_step(cuda: bool, dry_run: bool) -> dict[str, Any]:
    """The 1B-class step with offload off and on, beside the planner's prediction (the dry run: a tiny config, a
    short length, on the CPU)."""
    from longdoc.models import load_config
    from longdoc.runtime.resources import resource_dir

    if dry_run:
        model, device, seq_len, cap = "tiny:llama", "cpu", 256, None
        config = load_config(model)
    else:
        device, model, cap = "cuda", MODEL, MEMORY_CAP_GIB
        config = load_config(str(resource_dir("configs") / f"{MODEL}.json"))
        seq_len = longest_length(MODEL, device, cap)
        if seq_len == 0:
            return {"status": "failed", "why": f"the planner fits no length of {MODEL} under {cap} GiB"}
    planned = _plan(model, seq_len, device, cap).best
    out: dict[str, Any] = {"status": "ran", "model": model, "device": device, "seq_len": seq_len,
                           "memory_cap_gib": cap, "runs": []}
    if planned is not None:
        out["predicted_peak_gib"] = planned.to_dict()["peak_gib"]
        out["predicted_step_s"] = planned.to_dict()["step_s"]
    for offload in (False, True):
        try:
            run = train_step(config, seq_len, device, offload)
        except torch.cuda.OutOfMemoryError as err:  # a measurement too: the planner was wrong
            run = {"offload": offload, "status": "out of memory", "why": str(err).splitlines()[0]}
        predicted = _plan(model, seq_len, device, cap, offload=offload).best
        if predicted is not None:
            run["predicted_peak_gib"] = predicted.to_dict()["peak_gib"]
        if "peak_gib" in run and "predicted_peak_gib" in run:
            run["peak_vs_predicted"] = run["peak_gib"] / run["predicted_peak_gib"]
        out["runs"].append(run)
    if not cuda:
        out["why"] = "dry run on the CPU: a tiny config; GPU memory is measured only on a device"
    return out


def check(out_path: str | Path, dry_run: bool = False, budget_s: int = TIME_BUDGET_S) -> dict[str, Any]:
    """Run every part (those needing CUDA skipped by name without one) and write the JSON file atomically."""
    from longdoc.io import atomic_write_text

    cuda = torch.cuda.is_available() and not dry_run
    start = time.perf_counter()
    result: dict[str, Any] = {
        "kind": "gpu-check", "date": datetime.date.today().isoformat(), "dry_run": dry_run,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
    }
    result["tests"] = run_tests(cuda, timeout_s=budget_s // 2)
    result["kernels"] = run_kernels(cuda)
    result["step"] = run_step(cuda, dry_run)
    result["seconds"] = time.perf_counter() - start
    atomic_write_text(out_path, json.dumps(result, indent=2, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longdoc.bench.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/gpu-check.json", help="the JSON file (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="skip what needs CUDA, run the step tiny on the CPU")
    parser.add_argument("--budget-s", type=int, default=TIME_BUDGET_S, help="seconds for the whole check")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("longdoc gpu-check: no CUDA device here; run it on a GPU machine, or with --dry-run", file=sys.stderr)
        return 2
    result = check(args.out, args.dry_run, args.budget_s)
    failed = [k for k in ("tests", "kernels", "step") if result[k].get("status") == "failed"]
    parts = ", ".join(f"{k} {result[k].get('status')}" for k in ("tests", "kernels", "step"))
    print(f"gpu-check: {parts}; {result['seconds']:.0f} s; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
