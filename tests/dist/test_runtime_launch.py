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


def _environment(rank: int, world_size: int):
    import os

    return os.environ.get("LONGDOC_TEST_MARK"), os.getcwd(), os.getpid()


def test_ranks_take_the_callers_environment_and_folder_at_each_call(tmp_path, monkeypatch):
    """A variable or a working folder the caller set between two runs reaches the second run's ranks (each run's
    ranks are fresh processes, longdoc.runtime.spawn)."""
    monkeypatch.setenv("LONGDOC_TEST_MARK", "first")
    monkeypatch.chdir(tmp_path)
    first = run_ranks(2, _environment)
    monkeypatch.setenv("LONGDOC_TEST_MARK", "second")
    second = run_ranks(2, _environment)
    assert [m for m, *_ in first] == ["first", "first"] and [m for m, *_ in second] == ["second", "second"]
    assert {cwd for _, cwd, _ in first + second} == {str(tmp_path)}
    assert len({pid for *_, pid in first}) == len({pid for *_, pid in second}) == 2
