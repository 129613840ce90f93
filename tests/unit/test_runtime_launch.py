"""longdoc.runtime.launch: the world read from the launcher's variables or a joined group, and a process group that
is left only by the call that joined it."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from longdoc.runtime.launch import Launch, launched_world, process_group, set_launcher_env

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    # the whole environment is restored afterwards: set_launcher_env writes variables that were not set
    # before, which monkeypatch would not remove, and a later test would believe it runs under a launcher
    saved = dict(os.environ)
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    assert not dist.is_initialized()
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_a_plain_process_is_a_world_of_one(clean_env):
    world = launched_world()
    assert world == Launch(world_size=1, rank=0, local_rank=0, joined=False)
    assert not world.launched and world.is_main


def test_the_launchers_variables_give_the_world(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("RANK", "3")
    clean_env.setenv("LOCAL_RANK", "1")
    world = launched_world()
    assert world == Launch(world_size=4, rank=3, local_rank=1, joined=False)
    assert world.launched and not world.is_main


def test_a_garbled_variable_is_named(clean_env):
    clean_env.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE='two' is not an integer.*unset it"):
        launched_world()


def test_set_launcher_env_is_what_launched_world_reads(clean_env):
    set_launcher_env(1, 2, HF_HUB_OFFLINE="1")
    assert launched_world() == Launch(world_size=2, rank=1, local_rank=1, joined=False)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["MASTER_ADDR"] == "127.0.0.1"


def test_process_group_joins_and_leaves_only_what_it_joined(clean_env, tmp_path):
    init = f"file://{tmp_path / 'pg'}"
    with process_group("gloo", timeout=30, init_method=init, rank=0, world_size=1) as world:
        assert dist.is_initialized()
        assert world == Launch(world_size=1, rank=0, local_rank=0, joined=True) and world.launched
        with process_group("gloo", timeout=30) as inner:  # already joined: used as it is, not left
            assert inner == world
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_process_group_is_left_when_the_block_fails(clean_env, tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with process_group("gloo", timeout=30, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1):
            raise ValueError("boom")
    assert not dist.is_initialized()


def test_process_group_joins_from_the_launchers_variables(clean_env):
    """As under torchrun / accelerate launch: env:// from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    set_launcher_env(0, 1)
    clean_env.setenv("MASTER_PORT", str(port))
    with process_group("gloo", timeout=30) as world:
        assert world == Launch(world_size=1, rank=0, local_rank=0, joined=True)
    assert not dist.is_initialized()
