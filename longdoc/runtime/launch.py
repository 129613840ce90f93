"""Which distributed world this process was launched into, and joining its process group.

The one place that reads the launcher's variables (torchrun and `accelerate launch` set RANK, WORLD_SIZE,
LOCAL_RANK) and calls `init_process_group`; training (through Accelerate), evaluation, `longdoc verify` and
the local spawner (longdoc.runtime.spawn) all start here, so "am I one rank of several?" has one answer.

    world = launched_world()               # Launch(world_size=2, rank=1, local_rank=1, joined=False)
    with process_group(timeout=600) as w:  # joins (nccl on CUDA, else gloo) unless already joined
        ...
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Launch:
    """This process's place in the world it was started in."""

    world_size: int
    rank: int
    local_rank: int  # the device index on this node
    joined: bool  # a default process group exists already (joined by us, Accelerate or longdoc.runtime.spawn)
    node: int | None = None  # the launcher's node rank (torchrun's GROUP_RANK: --node-rank / --machine_rank)
    nodes: int = 1  # nodes in the launch (torchrun's GROUP_WORLD_SIZE: --nnodes / --num_machines)

    @property
    def launched(self) -> bool:
        """One rank of several (or already inside a group): the caller must not spawn ranks of its own."""
        return self.joined or self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0, the process that writes reports (also true for a plain single process)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer; the launcher sets it "
                           f"(torchrun / accelerate launch), unset it for a single-process run") from None


def launched_world() -> Launch:
    """The world from an initialized default process group, else from the launcher's environment."""
    local = _env_int("LOCAL_RANK", 0)
    node = _env_int("GROUP_RANK", -1)
    node, nodes = (None if node < 0 else node), _env_int("GROUP_WORLD_SIZE", 1)
    if dist.is_available() and dist.is_initialized():
        return Launch(dist.get_world_size(), dist.get_rank(), local, joined=True, node=node, nodes=nodes)
    return Launch(_env_int("WORLD_SIZE", 1), _env_int("RANK", 0), local, joined=False, node=node, nodes=nodes)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextmanager
def process_group(backend: str | None = None, *, timeout: float, init_method: str | None = None,
                  rank: int | None = None, world_size: int | None = None) -> Iterator[Launch]:
    """Join the default process group for the block and leave it afterwards; a group that already exists
    (Accelerate's, an outer caller's) is used as it is and left alone.

    Args:
        backend: "gloo" or "nccl"; None picks nccl when CUDA is available, else gloo.
        timeout: seconds any collective may wait before failing (instead of hanging).
        init_method, rank, world_size: as for `torch.distributed.init_process_group`; None reads the
            launcher's environment (env://).
    """
    owned = not dist.is_initialized()
    if owned:
        # torch's rendezvous wants integers or nothing: rank=None raises under torchrun's env://
        given = {k: v for k, v in (("rank", rank), ("world_size", world_size)) if v is not None}
        dist.init_process_group(backend or default_backend(), init_method=init_method,
                                timeout=datetime.timedelta(seconds=timeout), **given)
    try:
        yield launched_world()
    finally:
        if owned and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed teardown must not hide the result or the real error
                pass


def set_launcher_env(rank: int, world_size: int, **extra: str) -> None:
    """Make a rank started by longdoc.runtime.spawn look like one started by torchrun, for libraries that read the
    launcher's variables (Accelerate). `extra` sets further variables (e.g. HF_HUB_OFFLINE="1")."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", **extra)
