"""FSDP2 on CPU (gloo, torch 2.13): weights, gradients and AdamW moments sharded over all dp x cp ranks instead of
replicated per CP rank (issue 28 item 4; Accelerate applies FSDP only on GPUs, so the loop calls fully_shard itself).
Full fine-tuning at cp=2 and dp2 x cp2 equals one process: the logged losses, token counts and gradient norms, the
reduced gradients of every step, and the final weights."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.training import max_rel_err, ranks, tiny_recipe, train_on_ranks


def test_fsdp_on_cpu_equals_single_process(tmp_path):
    ref, ref_grads = ranks(1, train_on_ranks, tiny_recipe(tmp_path / "single"), [], deadline=300)[0]
    fsdp = {"train": {"fsdp": True}}
    runs = {"cp2": ranks(2, train_on_ranks, tiny_recipe(tmp_path / "cp2", **fsdp), ["cp_size=2"], deadline=300),
            "dp2cp2": ranks(4, train_on_ranks, tiny_recipe(tmp_path / "dp2cp2", **fsdp), ["cp_size=2"],
                            deadline=400)}
    w_ref = load_file(tmp_path / "single" / "final" / "model.safetensors")
    for name, per_rank in runs.items():
        for hist, grads in per_rank:
            for (s, loss, tok, gn), (s0, loss0, tok0, gn0) in zip(hist, ref, strict=True):
                assert (s, tok) == (s0, tok0), name
                assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6), name
                assert gn == pytest.approx(gn0, rel=1e-5), name  # the global norm of the sharded gradients
            for step_grads, step_ref in zip(grads, ref_grads, strict=True):
                for g, r in zip(step_grads, step_ref, strict=True):
                    assert float(abs(g - r).max()) <= 1e-5 * max(float(abs(r).max()), 1e-30), name
        assert max_rel_err(load_file(tmp_path / name / "final" / "model.safetensors"), w_ref) <= 1e-5, name


def test_fsdp_on_cpu_really_shards(tmp_path):
    """Each rank holds 1/world of every sharded parameter (not a replica): the optimizer's parameters are DTensors
    whose local shards add up to the model once."""
    sizes = ranks(2, _local_sizes, tiny_recipe(tmp_path / "s", train={"fsdp": True, "steps": 1}), ["cp_size=2"],
                  deadline=300)
    full, local = sizes[0][0], [s[1] for s in sizes]
    assert sum(local) == full and max(local) < 0.6 * full


def _local_sizes(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    import torch

    from tests.training import accelerate_env

    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    seen = {}
    step = torch.optim.AdamW.step

    def record(self, *args, **kwargs):
        params = [p for g in self.param_groups for p in g["params"]]
        assert all(type(p).__name__ == "DTensor" for p in params)
        seen["sizes"] = (sum(p.numel() for p in params), sum(p.to_local().numel() for p in params))
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = record
    train(recipe_from_dict(recipe, overrides))
    return seen["sizes"]
