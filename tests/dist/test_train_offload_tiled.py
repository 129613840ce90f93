"""Offloaded layer checkpoints and the sequence-tiled MLP are exact under CP: at cp 1, 2 and 4, ring and ulysses,
on a gated Llama, a plain-GeLU GPT-2 and a Mixtral MoE, the loss share and every local gradient of each rank are
bitwise those of the plain checkpointed model with offload on; with tiled MLPs (several tiles per rank) the loss
share is within fp32 1e-6 relative, and so is every gradient summed over the CP group (what the step applies).
One spawn per world size. Through `longdoc train`: offload and tiles at cp=2 (ring, DDP) below; both with FSDP at
cp=4 under ulysses, every reduced gradient against DDP, in test_train_fsdp_cpu.py."""

from __future__ import annotations

import pytest

from tests.support.distributed import run_ranks
from tests.support.offload_tiled_cases import ARCHS, TILE, batch, rel_err, step, tiny

STRATEGIES = ("ring", "ulysses")


def _summed(grad, cp):
    # the gradient the optimizer sees: summed over the CP group (a rank's share alone may cancel to near zero)
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad, group=cp.group)
    return grad


def _rank(rank: int, world_size: int) -> list[tuple]:
    import longdoc
    from longdoc.hf.offload import offload_checkpoints
    from longdoc.hf.tiled_mlp import tile_mlps

    cp = longdoc.ContextParallel(timeout=60)
    full = batch()
    rows = []
    for strategy in STRATEGIES:
        for arch in ARCHS:
            base = longdoc.patch(tiny(arch), cp, strategy=strategy)
            loss0, grads0 = step(base, cp, full)
            off_model = tiny(arch)
            offloader = offload_checkpoints(off_model)
            longdoc.patch(off_model, cp, strategy=strategy)
            loss1, grads1 = step(off_model, cp, full)
            tiled = tiny(arch)
            wrapped = tile_mlps(tiled, TILE)
            longdoc.patch(tiled, cp, strategy=strategy)
            loss2, grads2 = step(tiled, cp, full)
            rows.append(dict(
                case=f"{arch} {strategy} cp{world_size}",
                offload_bitwise=bool(loss1.equal(loss0)) and grads1.keys() == grads0.keys()
                and all(grads1[n].equal(grads0[n]) for n in grads0),
                moved=offloader.stats.moved, restored=offloader.stats.restored,
                layers=off_model.config.num_hidden_layers, wrapped=wrapped,
                tiled_loss=rel_err(loss2, loss0), same_keys=grads2.keys() == grads0.keys(),
                tiled_grad=max(rel_err(_summed(grads2[n], cp), _summed(grads0[n], cp)) for n in grads0),
                local_tokens=cp.shard_batch(full)["input_ids"].shape[1]))
    return rows


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_offload_and_tiled_mlp_exact_under_cp(world_size):
    per_rank = run_ranks(world_size, _rank, deadline=900, pg_timeout=60)
    for rows in per_rank:
        assert len(rows) == len(STRATEGIES) * len(ARCHS)
        for r in rows:
            assert r["offload_bitwise"], r
            assert r["moved"] == r["restored"] == r["layers"], r  # one input per checkpointed layer, each back once
            assert r["wrapped"] >= r["layers"] and r["local_tokens"] > 2 * TILE, r
            assert r["same_keys"] and r["tiled_loss"] <= 1e-6 and r["tiled_grad"] <= 1e-6, r


def test_train_loop_with_offload_and_tiled_mlp_cp2(tmp_path):
    """The recipe keys through `longdoc train` (Accelerate, DDP, chunked loss) at cp=2: offload leaves every logged
    loss and gradient norm bitwise unchanged; tiled MLPs (12-token tiles of 48 local tokens) within 1e-6."""
    from tests.support.training import ranks, tiny_recipe, train_cases

    train = {"steps": 2, "activation_checkpointing": True}
    recipes = {
        "plain": tiny_recipe(tmp_path / "plain", train=train),
        "offload": tiny_recipe(tmp_path / "offload", train=train, parallelism={"offload_checkpoints": True}),
        "tiled": tiny_recipe(tmp_path / "tiled", train=train, parallelism={"offload_checkpoints": True,
                                                                           "tiled_mlp": True, "mlp_tile_tokens": 12}),
    }
    out = ranks(2, train_cases, recipes, ["parallelism.cp_size=2"], deadline=600)
    for per_rank in out:
        plain, off, tiled = (per_rank[k]["history"] for k in ("plain", "offload", "tiled"))
        assert len(plain) == 2 and off == plain
        for (s0, loss0, tok0, gn0), (s1, loss1, tok1, gn1) in zip(plain, tiled):
            assert (s0, tok0) == (s1, tok1)
            assert abs(loss1 - loss0) <= 1e-6 * abs(loss0) and abs(gn1 - gn0) <= 1e-6 * abs(gn0), (plain, tiled)
