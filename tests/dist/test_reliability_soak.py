"""Soak: 200 optimizer steps of a tiny model at cp=2 with a new sequence length nearly every step.

Memory must stay flat (RSS slope over the second half) and the number of live tensors must not grow;
a hang fails through run_ranks' deadline. Prints the numbers the README quotes (run with -s).
"""

from __future__ import annotations

import json

import pytest

from tests.support.distributed import run_ranks
from tests.support.training import accelerate_env, tiny_recipe

STEPS = 200


def soak(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    accelerate_env(rank, world_size)
    import gc
    import warnings

    import psutil
    import torch

    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    proc, rss, tensors = psutil.Process(), [], {}

    def on_step(info):
        rss.append(proc.memory_info().rss / 2**20)
        if info.step % 20 == 0:
            gc.collect()
            with warnings.catch_warnings():  # isinstance touches deprecated torch module attributes
                warnings.simplefilter("ignore", FutureWarning)
                tensors[info.step] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    train(recipe_from_dict(recipe, overrides), on_step=on_step)
    return rss, tensors


def slope_per_100(values: list[float]) -> float:
    n = len(values)
    mx, my = (n - 1) / 2, sum(values) / n
    return 100 * sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


@pytest.mark.slow
def test_200_steps_varying_lengths_cp2_memory_flat(tmp_path):
    data = tmp_path / "rows.jsonl"
    with data.open("w") as f:  # 37 lengths from 40 to 328 tokens: shapes change every step
        for i in range(37):
            n = 40 + 8 * i
            f.write(json.dumps({"input_ids": [(7 * j + i) % 256 for j in range(n)]}) + "\n")
    recipe = tiny_recipe(tmp_path / "run", data={"path": str(data), "seq_len": 336, "shuffle": True})
    overrides = ["parallelism.cp_size=2", f"train.steps={STEPS}", "train.batch_size=1", "checkpoint.export=false",
                 "optim.warmup_steps=0"]
    out = run_ranks(2, soak, recipe, overrides, deadline=900)
    for rank, (rss, tensors) in enumerate(out):
        assert len(rss) == STEPS
        half = slope_per_100(rss[STEPS // 2:])
        counts = [tensors[s] for s in sorted(tensors)]
        print(f"rank {rank}: RSS {rss[0]:.0f} -> {rss[STEPS // 2]:.0f} -> {rss[-1]:.0f} MiB, 2nd-half slope "
              f"{half:+.2f} MiB/100 steps; live tensors every 20 steps {counts}")
        assert half < 8.0, f"rank {rank}: RSS grows {half:.1f} MiB per 100 steps in the second half"
        assert max(counts[1:]) <= counts[1] + 16, f"rank {rank}: live tensors grow: {counts}"
