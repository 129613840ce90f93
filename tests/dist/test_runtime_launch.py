"""A rank started by longdoc.runtime.spawn sees its place in the world through longdoc.runtime.launch, and a rank that
additionally gets the launcher's variables (for Accelerate) sees the same world. Ranks forked from one server do not
trip over each other's files, and a result sent just before a rank exits reaches the parent."""

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


def _check_one_folder(rank: int, world_size: int, folder: str) -> int:
    """Every rank checks the same output folder at the same moment, many times: ranks forked from one server share
    object ids, and a probe file named after one was written and unlinked by two ranks at once."""
    from pathlib import Path

    import torch.distributed as dist

    from longdoc.train.loop import _check_output

    for _ in range(50):
        dist.barrier()
        _check_output(Path(folder))
    return len(list(Path(folder).iterdir()))


def test_ranks_check_one_output_folder_at_once(tmp_path):
    assert run_ranks(2, _check_one_folder, str(tmp_path)) == [0, 0]  # no error, and no probe left behind


def _report_and_leave(rank: int, world_size: int, wait: float) -> int:
    import time

    time.sleep(wait if rank else 0.0)  # rank 0 reports and exits at once; the others a little later
    return rank


def test_a_rank_that_reports_and_exits_at_once_is_heard():
    """A rank's result is read even when the rank has exited by the time the parent looks (its pipe holds it)."""
    for wait in (0.0, 0.01, 0.05, 0.2):
        assert run_ranks(3, _report_and_leave, wait) == [0, 1, 2], wait
