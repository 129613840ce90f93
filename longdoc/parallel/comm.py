"""Communication for context parallelism: ring point-to-point, all-gather, all-to-all, agreement checks.

Every wait takes an explicit timeout, so a rank that never arrives turns into an error on the
others instead of a hang. Nothing here reads globals: the group travels in explicitly, and so does
the optional debug `guard` (longdoc.parallel.guard), which checks each op's tag across the group first.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from longdoc.parallel.guard import Guard, nbytes


def _peers(group: dist.ProcessGroup | None, peers: list[int] | None) -> str:
    # gloo/NCCL name a failed peer by address only; the user needs its rank (the launcher log shows why it died)
    try:
        me = dist.get_rank()
        if peers is None and group is not None:
            peers = [r for r in dist.get_process_group_ranks(group) if r != me]
        return f"rank {me}, waiting on rank(s) {sorted(set(peers or []))}: "
    except (RuntimeError, ValueError):  # no default group (a bare ProcessGroup): say what we can
        return ""


def _wait(work, timeout: datetime.timedelta | None, what: str, group: dist.ProcessGroup | None = None,
          peers: list[int] | None = None) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(
            f"context-parallel {what} failed or timed out on {_peers(group, peers)}{e}; one of those ranks "
            f"probably crashed (see its log), skipped this call, or passed tensors of another shape"
        ) from e


class Pending:
    """Handles of in-flight operations; `wait()` completes them all."""

    def __init__(self, works: list, timeout: datetime.timedelta | None, what: str, peers: list[int] | None = None):
        self.works, self.timeout, self.what, self.peers = works, timeout, what, peers

    def wait(self) -> None:
        for w in self.works:
            _wait(w, self.timeout, self.what, peers=self.peers)
        self.works = []


class Ring:
    """Send to the next rank and receive from the previous one, in the order of `group`."""

    def __init__(self, group: dist.ProcessGroup, timeout: datetime.timedelta | None = None,
                 guard: Guard | None = None):
        self.group, self.timeout, self.guard = group, timeout, guard
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> Pending:
        """Start sending `send` to the next rank and receiving into `recv` from the previous one."""
        if self.guard is not None:
            self.guard.check(f"ring shift tag={tag}", nbytes(send))
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return Pending(dist.batch_isend_irecv(ops), self.timeout, "ring send/recv", [self.prev, self.next])


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, timeout: datetime.timedelta | None,
               guard: Guard | None = None, what: str = "all_gather") -> list[torch.Tensor]:
    """Every rank's `x` (same shape on all ranks), in group rank order."""
    if guard is not None:
        guard.check(what, nbytes(x))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(parts, x.contiguous(), group=group, async_op=True), timeout, "all-gather", group)
    return parts


def reduce_scatter(parts: list[torch.Tensor], group: dist.ProcessGroup,
                   timeout: datetime.timedelta | None, guard: Guard | None = None,
                   what: str = "reduce_scatter") -> torch.Tensor:
    """Sum over ranks of `parts[rank]`. NCCL reduce-scatters; gloo has no reduce-scatter, so all-reduce."""
    if guard is not None:
        guard.check(what, nbytes(*parts))
    rank = dist.get_rank(group)
    if dist.get_backend(group) == dist.Backend.NCCL:
        out = torch.empty_like(parts[rank])
        _wait(dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group, async_op=True),
              timeout, "reduce-scatter", group)
        return out
    flat = torch.stack(parts)
    _wait(dist.all_reduce(flat, group=group, async_op=True), timeout, "all-reduce", group)
    return flat[rank]


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, timeout: datetime.timedelta | None,
               guard: Guard | None = None, what: str = "all_reduce") -> torch.Tensor:
    """The sum over ranks of `x`, in place (pass a contiguous tensor the caller owns), returned."""
    x = x.contiguous()
    if guard is not None:
        guard.check(what, nbytes(x))
    _wait(dist.all_reduce(x, group=group, async_op=True), timeout, what.replace("_", "-"), group)
    return x


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup,
               timeout: datetime.timedelta | None, guard: Guard | None = None, what: str = "all_to_all",
               size: int | None = None) -> torch.Tensor:
    """One all-to-all of flat buffers: `send_splits[j]` elements of `send` (in rank order) go to rank j, and the
    result holds `recv_splits[s]` elements from each rank s, in rank order.

    Splits may differ per peer (uneven head groups). gloo and NCCL both implement the single-buffer form with
    splits; gloo's list form (`dist.all_to_all`) refuses tensors of unequal size, so that one is not used.
    """
    if guard is not None:  # size: the bytes the guard compares, where the ranks' send sizes may rightly differ
        guard.check(what, nbytes(send) if size is None else size)
    recv = send.new_empty(sum(recv_splits))
    work = dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=True)
    _wait(work, timeout, what.replace("_", "-"), group)
    return recv


def agree(values: list[int], group: dist.ProcessGroup, timeout: datetime.timedelta | None,
          device: torch.device, guard: Guard | None = None, what: str = "agree") -> list[list[int]]:
    """All ranks' `values` (same length everywhere): the cheap check before exchanging real data."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return [p.tolist() for p in all_gather(mine, group, timeout, guard, f"{what} ({len(values)} ints)")]
