"""Kill a cp=2 run while it writes a checkpoint, resume: the loss trajectory continues exactly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.support.training import accelerate_env, ranks, tiny_recipe


def train_until_killed(rank: int, world_size: int, recipe: dict, overrides: list[str], kill_at: str, pids: str):
    """Train; when rank 0 is about to rename `kill_at` into place, SIGKILL every rank (the whole job)."""
    accelerate_env(rank, world_size)
    Path(pids, f"{rank}.pid").write_text(str(os.getpid()))
    from longdoc.train import checkpoint, recipe_from_dict
    from longdoc.train.loop import train

    rename = os.rename

    def killing_rename(src, dst):
        if Path(src).name == kill_at:
            for f in Path(pids).glob("*.pid"):
                if int(f.read_text()) != os.getpid():
                    os.kill(int(f.read_text()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return rename(src, dst)

    checkpoint.os.rename = killing_rename
    train(recipe_from_dict(recipe, overrides))
    return "finished without being killed"


def train_history(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    return [(s.step, s.loss) for s in train(recipe_from_dict(recipe, overrides)).history]


@pytest.mark.slow  # fast: test_lora_resume_after_kill_continues_exactly_on_any_cp_size (a cp change too)
def test_resume_after_kill_continues_exactly(tmp_path):
    overrides = ["parallelism.cp_size=2", "train.steps=8", "checkpoint.every=2", "checkpoint.keep=2",
                 "checkpoint.export=false"]
    full = ranks(2, train_history, tiny_recipe(tmp_path / "full"), overrides)[0]
    assert [s for s, _ in full] == list(range(1, 9))

    run = tmp_path / "killed"
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match="gave no result"):
        ranks(2, train_until_killed, tiny_recipe(run), overrides, ".step-00000006.tmp", str(pids), deadline=200)
    ck = run / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert names == [".step-00000006.tmp", "step-00000002", "step-00000004"], names
    # a folder that looks like a checkpoint but has no trainer state (e.g. a partial copy) is never used
    (ck / "step-00000008" / "state").mkdir(parents=True)

    resumed = ranks(2, train_history, tiny_recipe(run), overrides + ["resume=true"])
    for hist in resumed:
        assert [s for s, _ in hist] == [5, 6, 7, 8]
        for (s, loss), (s_full, loss_full) in zip(hist, full[4:], strict=True):
            assert s == s_full
            assert loss == pytest.approx(loss_full, abs=1e-6, rel=0), (s, loss, loss_full)
    # the metrics file is one trajectory: steps 1..8 once each, equal to the uninterrupted run
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert [r["loss"] for r in logged] == pytest.approx([loss for _, loss in full], abs=1e-6, rel=0)
    assert not (ck / ".step-00000006.tmp").exists()  # swept at the resumed start
    assert (ck / "step-00000008" / "trainer.json").is_file()  # rewritten complete by the resumed run


LORA = ["lora.enabled=true", "lora.r=4", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
        "checkpoint.export=false"]


def _same(hist, ref, tol):
    assert [s for s, _ in hist] == [s for s, _ in ref]
    assert [loss for _, loss in hist] == pytest.approx([loss for _, loss in ref], abs=tol, rel=0)


def test_lora_resume_after_kill_continues_exactly_on_any_cp_size(tmp_path):
    """A LoRA checkpoint holds the adapter only (the frozen base is rebuilt from the recipe): resuming
    it used to fail with `Missing key(s) in state_dict`. Killed at cp=2, resumed at cp=2, cp=1 (reshard)."""
    full = {cp: ranks(cp, train_history, tiny_recipe(tmp_path / f"full{cp}"), LORA + [f"parallelism.cp_size={cp}"])[0]
            for cp in (1, 2)}
    assert [s for s, _ in full[2]] == list(range(1, 7))
    _same(full[2], full[1], 1e-5)  # cp=2 is the single-process run

    run = tmp_path / "killed"
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match="gave no result"):
        ranks(2, train_until_killed, tiny_recipe(run), LORA + ["parallelism.cp_size=2"], ".step-00000004.tmp",
              str(pids), deadline=200)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".step-00000004.tmp", "step-00000002"]
    state = json.loads((run / "checkpoints" / "step-00000002" / "trainer.json").read_text())
    assert state["frozen"]["count"] > 0  # the base was left out, and its digest kept

    import shutil
    other = tmp_path / "killed-cp1"
    shutil.copytree(run, other)
    for hist in ranks(2, train_history, tiny_recipe(run), LORA + ["parallelism.cp_size=2", "resume=true"]):
        _same(hist, full[2][2:], 1e-6)
    (cp1,) = ranks(1, train_history, tiny_recipe(other), LORA + ["parallelism.cp_size=1", "resume=true"])
    _same(cp1, full[1][2:], 1e-5)


def test_lora_resume_at_cp1_is_exact(tmp_path):
    import shutil

    run = tmp_path / "run"
    every3 = LORA + ["checkpoint.every=3"]
    full = ranks(1, train_history, tiny_recipe(run), every3)[0]
    shutil.rmtree(run / "checkpoints" / "step-00000006")  # as if killed after step 5
    resumed = ranks(1, train_history, tiny_recipe(run), every3 + ["resume=true"])[0]
    _same(resumed, full[3:], 1e-6)
