"""The CPU demo recipe end to end through `accelerate launch` (slow: the real 135M model at 4k tokens).

    .venv/bin/python -m pytest -m slow -s tests/dist/test_train_demo.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * 3600)]


def test_cpu_demo_recipe_cp2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    data = tmp_path / "legal.jsonl"
    subprocess.run([sys.executable, "-m", "longdoc", "data", "synth", "--domain", "legal", "--num-docs", "2",
                    "--tokens", "4096", "--seed", "0", "--out", str(data)], check=True, env=env, cwd=ROOT)
    out = tmp_path / "run"
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.run([str(accelerate), "launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
                           "-m", "longdoc", "train", "recipes/cpu-demo.yaml", f"output_dir={out}",
                           f"data.path={data}", "train.steps=4", "checkpoint.every=2", "log.progress=false"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 = dp 1 x cp 2" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print("\n".join(f"step {r['step']}: loss {r['loss']:.4f}, {r['step_s']:.1f} s, {r['tokens_per_s']:.0f} tok/s, "
                    f"peak {r['peak_gb_max']:.2f} GB/rank, logits rows {r['logit_rows_max']}" for r in rows))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # every rank holds half the sequence; no logits block ever exceeded one 1024-token chunk
    assert all(r["logit_rows_max"] <= 1024 < r["local_tokens"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "final" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
