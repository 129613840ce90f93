"""A rank started by longdoc.runtime.spawn sees its place in the world through longdoc.runtime.launch, and a rank that
additionally gets the launcher's variables (for Accelerate) sees the same world."""

from __future__ import annotations

from tests.support.distributed import run_ranks


def _where_am_i(rank: int, world_size: int):
    from longdoc.runtime.launch import launched_world, set_launcher_env

    joined = launched_world()
    set_launcher_env(rank, world_size)
    return (joined.world_size, joined.rank, joined.joined), launched_world()


def test_spawned_ranks_know_their_world():
    out = run_ranks(3, _where_am_i)
    assert [seen for seen, _ in out] == [(3, 0, True), (3, 1, True), (3, 2, True)]
    assert [(w.world_size, w.rank, w.local_rank, w.is_main) for _, w in out] == [
        (3, 0, 0, True), (3, 1, 1, False), (3, 2, 2, False)]
