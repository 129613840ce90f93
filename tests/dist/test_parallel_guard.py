"""The debug guard (longdoc.parallel.guard): collectives issued out of order fail at once, naming what each rank
was about to do, instead of crashing in gloo or mixing two messages silently; and issue 22's bug, put back on
purpose, is named by the rank at fault."""

from __future__ import annotations

import json

from tests.support.distributed import run_ranks
from tests.support.training import accelerate_env, ranks, tiny_recipe


def _scenarios(rank: int, world_size: int, scenarios: list[tuple[dict, float, float]]) -> list[tuple]:
    """Each scenario on a fresh group: every rank checks its ops in turn; (status, checks done, message)."""
    import time

    import torch.distributed as dist

    from longdoc.parallel.guard import CollectiveMismatchError, Guard

    out = []
    for ops_by_rank, timeout, linger in scenarios:
        guard = Guard(dist.new_group(list(range(world_size))), "test", timeout)
        try:
            for op, size in ops_by_rank[rank]:
                guard.check(op, size)
            out.append(("ok", guard.seq, ""))
            time.sleep(linger)  # a rank that skipped an op stays alive: the others must time out, not see it die
        except CollectiveMismatchError as e:
            out.append(("mismatch", guard.seq, str(e)))
    return out


def test_guard_names_both_ops_on_a_mismatch_and_times_out_on_a_skipped_one():
    same = [("ring shift tag=0", 4096), ("all_reduce loss", 8)]
    scenarios = [
        ({0: same, 1: same}, 60, 0),
        # issue 22's crossing: one rank's gradient bucket against the other's 8-byte loss sum, as collective #2
        ({0: [same[0], ("ddp bucket 0 all_reduce", 909360)], 1: same}, 60, 0),
        # equal sizes would pass gloo's size check and mix silently: the tags still differ
        ({0: [("all_reduce peak memory", 8)], 1: [("all_reduce loss", 8)]}, 60, 0),
        # rank 1 never issues its second op: rank 0 is told which op it waits in, after the timeout (last: the
        # shadow group of a timed-out check is not used again)
        ({0: same, 1: same[:1]}, 2.0, 8.0),
    ]
    (ok0, crossed0, silent0, skipped0), (ok1, crossed1, silent1, skipped1) = run_ranks(2, _scenarios, scenarios)
    assert ok0 == ok1 == ("ok", 2, "")
    for status, seq, msg in (crossed0, crossed1):
        assert status == "mismatch" and seq == 2, msg
        assert "collective #2 on the 'test' group" in msg
        assert "rank 0 issues 'ddp bucket 0 all_reduce' (909360 bytes" in msg
        assert "rank 1 issues 'all_reduce loss' (8 bytes" in msg
    for status, _, msg in (silent0, silent1):
        assert status == "mismatch" and "'all_reduce peak memory'" in msg and "'all_reduce loss'" in msg, msg
    status, _, msg = skipped0
    assert status == "mismatch" and "'all_reduce loss'" in msg and "#2" in msg and "not every rank" in msg, msg
    assert skipped1 == ("ok", 1, "")


def _train_with_old_loss(rank: int, world_size: int, recipe: dict):
    """Issue 22's loss, put back: a rank without loss tokens skips the head (the bug this guard exists for)."""
    accelerate_env(rank, world_size)  # LONGDOC_DEBUG_COLLECTIVES=1
    from longdoc.train import loss, recipe_from_dict
    from longdoc.train.loop import train

    fixed = loss.chunked_ce_sum

    def old(head, hidden, labels, chunk_tokens, weights=None):
        if bool((labels == loss.IGNORE).all()):
            return hidden.new_zeros((), dtype=hidden.dtype) + 0.0 * hidden.sum()
        return fixed(head, hidden, labels, chunk_tokens, weights)

    loss.chunked_ce_sum = old
    train(recipe_from_dict(recipe, ["parallelism.cp_size=2"]))


def test_guard_names_the_parameter_without_gradient(tmp_path):
    import torch

    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for _ in range(4):
            ids = torch.randint(0, 49152, (96,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 90 + ids[90:]}) + "\n")  # answer-only
    rec = tiny_recipe(tmp_path / "run", model={"name": "tiny:llama", "overrides": {}},
                      data={"path": str(tmp_path / "rows.jsonl"), "seq_len": 96},
                      train={"activation_checkpointing": False, "steps": 1}, checkpoint={"export": False})
    out = ranks(2, _train_with_old_loss, rec, allow_errors=True, pg_timeout=60, deadline=300)
    assert all(isinstance(r, tuple) and r[0] == "error" for r in out), out
    # CP rank 1 holds no loss token: it names the head, before it issues anything else
    assert "CollectiveMismatchError" in out[1][1] and "on rank 1: 1 trainable parameter(s) received no gradient (" \
        in out[1][1] and "lm_head.weight)" in out[1][1], out[1][1]
