"""`longdoc train` end to end: refusals exit 2 with one line, damaged checkpoints name the file, writes stay
inside output_dir, ranks that disagree on a batch stop together, nothing is saved from a non-finite state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.training import accelerate_env, tiny_recipe, train_with_nan_at

ROOT = Path(__file__).resolve().parents[2]
BASE = ["model.name=tiny:llama", "model.overrides.vocab_size=256", "data.path=random", "data.seq_len=64",
        "data.random_size=4", "train.steps=2", "train.loss_chunk_tokens=16", "log.progress=false"]


def longdoc_train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    recipe = cwd.parent / "recipe.yaml"
    recipe.write_text("{}\n")  # everything from the overrides
    return subprocess.run([sys.executable, "-m", "longdoc", "train", str(recipe), *BASE, *overrides], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # five `longdoc train` processes: ~80 s on 2 cores
def test_cli_run_writes_only_inside_output_dir_and_refuses_damage_clearly(tmp_path):
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    r = longdoc_train(cwd, f"output_dir={out}", "log.tensorboard=true", "log.plot=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "out", "recipe.yaml"] and not list(cwd.iterdir())
    ck = out / "checkpoints" / "step-00000002"
    assert (ck / "trainer.json").is_file() and (out / "final" / "model.safetensors").is_file()

    # another model (same name, other architecture overrides) is refused before loading anything
    r = longdoc_train(cwd, f"output_dir={out}", "resume=true", "train.steps=3", "model.overrides.hidden_size=128")
    assert r.returncode == 2 and "cannot resume: the checkpoint was made with model.overrides=" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    # a truncated tensor file: exit 2, the file's folder named, the fix said; never a torch traceback
    shard = next((ck / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    r = longdoc_train(cwd, f"output_dir={out}", "resume=true", "train.steps=3")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"checkpoint {ck / 'state'} could not be loaded" in r.stderr and f"delete {ck}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    # a model feature CP cannot reproduce: one line naming it, exit 2
    r = longdoc_train(cwd, f"output_dir={tmp_path / 'drop'}", "model.overrides.attention_dropout=0.1")
    assert r.returncode == 2 and "uses attention dropout in training mode (p=0.1)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def train_with_skewed_batch(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    """Rank 1's collate returns a batch 8 tokens longer than rank 0's in step 2: a data bug on one CP rank."""
    accelerate_env(rank, world_size)
    from longdoc.train import data, loop, recipe_from_dict, step

    collate, calls = data.collate, {"n": 0}

    def skewed(seqs, idx, pad_id, step=None):
        batch = collate(seqs, idx, pad_id, step)
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            batch = {k: torch.cat([v, v[:, :8]], dim=1) for k, v in batch.items()}
        return batch

    step.collate = skewed
    try:
        loop.train(recipe_from_dict(recipe, overrides))
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return type(e).__name__, str(e)
    return "finished", ""


def test_cp_ranks_with_different_batch_shapes_stop_with_the_same_error(tmp_path):
    out = run_ranks(2, train_with_skewed_batch, tiny_recipe(tmp_path / "run"),
                    ["parallelism.cp_size=2", "train.batch_size=1"], deadline=200)
    assert out[0][0] == out[1][0] != "finished", out
    # cp.shard_batch compares the full batches before any attention runs: 96 tokens on rank 0, 104 on rank 1
    for _, msg in out:
        assert "CP ranks hold different batches" in msg and "96" in msg and "104" in msg, out


def test_no_checkpoint_is_written_from_a_nonfinite_state(tmp_path):
    overrides = ["parallelism.cp_size=2", "train.steps=2", "train.batch_size=1", "checkpoint.every=1",
                 "checkpoint.keep=5", "checkpoint.export=false"]
    out = run_ranks(2, train_with_nan_at, tiny_recipe(tmp_path / "abort"), overrides + ["train.on_nonfinite=abort"], 2)
    assert all(status == "aborted" for status, _ in out), out
    assert sorted(p.name for p in (tmp_path / "abort" / "checkpoints").iterdir()) == ["step-00000001"]
    run_ranks(2, train_with_nan_at, tiny_recipe(tmp_path / "skip"), overrides, 2)
    ck = tmp_path / "skip" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000001", "step-00000002"]
    # the skipped step saved the step-1 weights and optimizer state, all finite
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for step in (1, 2):
        dcp_to_torch_save(ck / f"step-0000000{step}" / "state", tmp_path / f"s{step}.pt")
        states.append(torch.load(tmp_path / f"s{step}.pt", weights_only=True))
    for k, v in states[1]["model"].items():
        assert torch.isfinite(v).all() and torch.equal(v, states[0]["model"][k]), k
