"""Rank function of the `longdoc train` preference test (tests/dist/test_train_dpo_e2e.py): one training run on
preference rows, counting the reference forwards (longdoc.runtime.spawn pickles it by module and name)."""

from __future__ import annotations

from tests.support.training import accelerate_env


def train_counting_references(rank: int, world_size: int, recipe: dict, overrides: list[str]) -> dict:
    """The run's per-step (loss, grad_norm, metrics) and how many times the LoRA-disabled reference ran."""
    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train
    from longdoc.train.loss import LossModel

    base, calls = LossModel.base, {"n": 0}

    def counted(self):
        calls["n"] += 1
        return base(self)

    LossModel.base = counted
    hist = train(recipe_from_dict(recipe, overrides)).history
    return {"steps": [(s.step, s.loss, s.grad_norm, s.metrics) for s in hist], "references": calls["n"]}
