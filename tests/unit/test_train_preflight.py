"""`longdoc train` checks in the parent process, before any rank starts or any weights load, what it can: the
output folder against `resume`, the model name and context, the data paths. Bad input there is one line and exit 2
with no rank started (it used to surface 19-44 s later, inside the ranks, at cp=2). And `resume` says what it did.

The refusals run in the test's process (tests.support.cli.here) with longdoc.runtime.spawn.run_local failing the
test if called. That nothing but the line reaches the terminal of a fresh `python -m longdoc train ...
parallelism.cp_size=2` (it passes this preflight, then its ranks refuse the model) is test_cli_errors' FRESH case."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli import fresh, here

SPAWNED = "starting 2 local CPU processes"
RECIPE = ("model: {name: 'tiny:llama', overrides: {vocab_size: 256}}\n"
          "data: {path: random, seq_len: 64, random_size: 4}\n"
          "train: {steps: 1, mixed_precision: 'no'}\n"
          "checkpoint: {export: false}\n"
          "log: {progress: false, tensorboard: false, plot: false}\n")


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return fresh("train", "recipe.yaml", *args, cwd=tmp, OMP_NUM_THREADS="1")


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    return tmp_path


@pytest.mark.parametrize("args, says", [
    (["output_dir=typo", "resume=true"], "resume=true but output_dir typo holds no complete checkpoint"),
    (["output_dir=o", "data.path=missing/cases.jsonl"], "data.path: missing/cases.jsonl does not exist"),
    (["output_dir=o", "data.path=blob.bin", "data.task=pretrain"], "data: blob.bin: unknown file type '.bin'"),
    (["output_dir=o", "data.seq_len=1M"], "data.seq_len=1048576 exceeds the model's context (131072 tokens)"),
    (["output_dir=o", "model.name=tiny:lama"], "unknown tiny architecture 'lama'"),
], ids=["resume", "data-missing", "data-type", "context", "model"])
def test_bad_input_is_refused_in_the_parent_before_any_rank_starts(tmp, monkeypatch, capfd, args, says):
    import longdoc.runtime.spawn

    monkeypatch.setattr(longdoc.runtime.spawn, "run_local", lambda *a, **k: pytest.fail("the ranks started"))
    proc = here("train", "recipe.yaml", *args, "parallelism.cp_size=2", cwd=tmp, monkeypatch=monkeypatch,
                capfd=capfd, OMP_NUM_THREADS="1")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith(f"longdoc train: error: {says}"), lines[0]
    assert SPAWNED not in proc.stdout, proc.stdout  # found before the ranks, not inside them
    assert not (tmp / "o").exists() and not (tmp / "typo").exists()  # nothing written either


def test_resume_auto_starts_fresh_then_resume_says_where_it_continues(tmp):
    first = _train(tmp, "output_dir=run", "resume=auto", "parallelism.cp_size=1", "checkpoint.at_end=true")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "resume=auto: run/checkpoints holds no complete checkpoint yet: starting from step 0" in first.stdout
    second = _train(tmp, "output_dir=run", "resume=true", "train.steps=2", "parallelism.cp_size=1")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 1 (run/checkpoints/step-00000001)" in second.stdout, second.stdout
    assert "done, 2 steps" in second.stdout
