"""What the loop does with a non-finite step, and with a resume that would not continue the same run."""

from __future__ import annotations

import pytest

from tests.support.training import accelerate_env, ranks, tiny_recipe, train_with_nan_at


def test_nonfinite_step_is_skipped_on_every_rank_or_aborts(tmp_path):
    overrides = ["parallelism.cp_size=2", "train.steps=4", "train.batch_size=1"]
    (hist, sums), (hist1, sums1) = ranks(2, train_with_nan_at, tiny_recipe(tmp_path / "skip"), overrides, 2)
    assert hist == hist1 == [(1, False), (2, True), (3, False), (4, False)]
    assert sums[1] == sums[0] and sums[2] != sums[1]  # the skipped step left the weights untouched
    assert sums == sums1  # both ranks made the same decision
    out = ranks(2, train_with_nan_at, tiny_recipe(tmp_path / "abort"), overrides + ["train.on_nonfinite=abort"], 2)
    for status, msg in out:
        assert status == "aborted" and "step 2" in msg and "not finite" in msg


def train_plain(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    accelerate_env(rank, world_size)
    from longdoc.train import checkpoint, recipe_from_dict
    from longdoc.train.config import RecipeError
    from longdoc.train.loop import train

    try:
        return len(train(recipe_from_dict(recipe, overrides)).history)
    except (RecipeError, checkpoint.CheckpointError) as e:
        return ("error", str(e))


def test_resume_guards(tmp_path):
    rec = tiny_recipe(tmp_path / "run")
    base = ["train.steps=2", "checkpoint.at_end=true", "checkpoint.export=false"]
    assert ranks(1, train_plain, rec, base)[0] == 2
    status, msg = ranks(1, train_plain, rec, base)[0]  # a second run into the same folder
    assert status == "error" and "resume=true" in msg and "overwrite=true" in msg
    status, msg = ranks(1, train_plain, rec, base + ["resume=true", "seed=1"])[0]
    assert status == "error" and "seed=0" in msg and "fresh output_dir" in msg
    # a finished run resumed with more steps continues; on another CP size it reshards (world 2, cp 2)
    assert ranks(2, train_plain, rec, ["train.steps=3", "resume=true", "parallelism.cp_size=2",
                                           "checkpoint.export=false"]) == [1, 1]
    assert ranks(1, train_plain, rec, base + ["overwrite=true"])[0] == 2


def test_unwritable_output_dir(tmp_path):
    from longdoc.train.config import RecipeError
    from longdoc.train.loop import _check_output

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RecipeError, match="not writable"):
        _check_output(blocker / "run")
