"""`longdoc train` validation under CP equals one process; early stopping ends the run."""

from __future__ import annotations

from tests.support.training import accelerate_env, ranks, tiny_recipe


def _train(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train
    from longdoc.train.metrics import read_jsonl

    # one train() per spawned process: Accelerate's end_training takes the process group down
    result = train(recipe_from_dict(recipe, overrides))
    logged = [r["val_loss"] for r in read_jsonl(result.output_dir / "metrics.jsonl") if "val_loss" in r]
    return result.val_losses, result.losses, result.steps_done, result.stopped_early, logged


def _recipe(out) -> dict:
    # 3 held-out rows at micro-batch 1 over dp=2 replicas would be uneven; here dp=1 and the rows are the last 3
    # of the data. min_delta 100 makes the second validation "no improvement": patience 1 stops at step 2 of 5.
    return tiny_recipe(out, eval={"every": 1, "holdout": 3, "patience": 1, "min_delta": 100.0},
                       train={"steps": 5})


def test_validation_under_cp_equals_single_process_and_early_stopping(tmp_path):
    ref_val, ref_loss, ref_steps, ref_stopped, ref_logged = ranks(1, _train, _recipe(tmp_path / "one"), [])[0]
    assert ref_steps == 2 and ref_stopped and [s for s, _ in ref_val] == [1, 2]
    assert ref_logged == [v for _, v in ref_val]
    for val, loss, steps, stopped, logged in ranks(2, _train, _recipe(tmp_path / "cp2"), ["parallelism.cp_size=2"]):
        assert steps == 2 and stopped and [s for s, _ in val] == [1, 2]
        for (_, a), (_, b) in zip(val, ref_val, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (val, ref_val)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(loss, ref_loss, strict=True)), (loss, ref_loss)
        if logged:  # metrics.jsonl is written by rank 0 only
            assert logged == [v for _, v in val]
