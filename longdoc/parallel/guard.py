"""Debug check of collective order: every rank of a group must issue the same collectives in the same order.

    LONGDOC_DEBUG_COLLECTIVES=1 accelerate launch ... -m longdoc train RECIPE    # or train.debug_collectives=true
    cp = ContextParallel(group, debug_collectives=True)                            # the plain API

gloo and NCCL match the n-th collective of a group on one rank with the n-th on every other. When two ranks
issue different collectives at the same position, gloo aborts the process with a size check ("op.preamble.length
<= op.nbytes") or, when the sizes happen to agree, silently mixes the two messages; NCCL does not even check
sizes. A `Guard` makes that fail at once, by name: before each collective longdoc issues on its group, the ranks
all-gather (sequence number, op tag, bytes) on a private gloo "shadow" group and compare. A mismatch raises
`CollectiveMismatchError` on every rank of the group, naming what each rank was about to do; a rank that never
arrives turns into the same error after the timeout, naming the op the others wait in.

A collective that is never issued cannot be tagged; the usual way one goes missing is a gradient bucket of
DDP that never fills because a parameter received no gradient on one rank. `GradCoverage` checks that
locally after every backward, before the next collective, and names the parameters.

Off (the default) nothing here runs: call sites hold `guard=None` and test it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

ENV_FLAG = "LONGDOC_DEBUG_COLLECTIVES"
_TAG_CHARS = 72  # an op tag longer than this is cut (it only names the op in the error)


def debug_collectives_from_env() -> bool:
    """The LONGDOC_DEBUG_COLLECTIVES switch; read by entry points at start-up only (never deep inside)."""
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes", "on")


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group were about to issue different collectives (or one never issued its own)."""


def _encode(seq: int, nbytes: int, op: str) -> torch.Tensor:
    chars = list(op.encode("ascii", "replace")[:_TAG_CHARS])
    return torch.tensor([seq, nbytes, len(chars)] + chars + [0] * (_TAG_CHARS - len(chars)), dtype=torch.int64)


def _decode(t: torch.Tensor) -> tuple[int, int, str]:
    v = t.tolist()
    return v[0], v[1], bytes(v[3:3 + v[2]]).decode("ascii", "replace")


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Guard:
    """Sequence numbers and op tags for the collectives longdoc issues on one process group, checked across it.

    Construct it on every rank of `group` at the same point (it creates the shadow group; non-members need
    not take part). `name` says which stream the group carries ("cp", "grads", "scalars", ...).
    """

    def __init__(self, group: dist.ProcessGroup, name: str, timeout: datetime.timedelta | float | None = None):
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.name, self.timeout = name, timeout
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        # gloo whatever the real group's backend: the check runs on the host, inside autograd hooks too
        self.shadow = dist.new_group(self.ranks, backend="gloo", use_local_synchronization=True,
                                     **({"timeout": timeout} if timeout is not None else {}))
        self.seq = 0

    def __repr__(self) -> str:
        return f"Guard({self.name!r}, ranks={self.ranks}, seq={self.seq})"

    def check(self, op: str, size: int) -> None:
        """Call on every rank right before issuing collective `op` (a short tag) of `size` bytes on the group."""
        self.seq += 1
        mine = _encode(self.seq, int(size), op)
        parts = [torch.empty_like(mine) for _ in self.ranks]
        what = f"collective #{self.seq} on the {self.name!r} group (global ranks {self.ranks})"
        try:
            work = dist.all_gather(parts, mine, group=self.shadow, async_op=True)
            work.wait() if self.timeout is None else work.wait(self.timeout)
        except RuntimeError as e:
            raise CollectiveMismatchError(
                f"debug_collectives: rank {self.rank} is about to issue {op!r} ({size} bytes) as {what}, but not "
                f"every rank of the group reached its own #{self.seq} ({e}); a rank skipped a collective, failed "
                f"(see its log, the first error there is the cause) or is blocked in another group") from e
        records = [_decode(p) for p in parts]
        if any(r != records[0] for r in records):
            detail = "; ".join(f"rank {g} issues {o!r} ({b} bytes, its #{s})"
                               for g, (s, b, o) in zip(self.ranks, records, strict=True))
            raise CollectiveMismatchError(
                f"debug_collectives: the ranks disagree on {what}: {detail}. Every rank of a group must issue the "
                f"same collectives in the same order; without this check the run would crash in the transport "
                f"or mix the two messages silently")


class GradCoverage:
    """Every trainable parameter must receive a gradient in every backward, on every rank.

    DDP fills a gradient bucket when all its parameters have one and reduces buckets in order; a parameter
    without a gradient on one rank leaves that rank's buckets unsent while its peers send theirs (then a
    hang, or a crash when the next collective on the group crosses them). Checked locally after backward,
    so the rank at fault names the parameters before it issues anything else.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]):
        self.names: list[str] = []
        self.seen: set[str] = set()
        self._hooks = []
        for name, p in named_parameters:
            if p.requires_grad:
                self.names.append(name)
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, n=name: self.seen.add(n)))

    def check(self, where: str) -> None:
        missing = [n for n in self.names if n not in self.seen]
        self.seen.clear()
        if missing:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise CollectiveMismatchError(
                f"debug_collectives: {where} on rank {rank}: {len(missing)} trainable parameter(s) received no "
                f"gradient ({shown}). DDP/FSDP reduce gradients in buckets that every rank must fill in the same "
                f"backward; keep every trainable parameter in the loss graph on every rank (a zero-weighted term), "
                f"or wrap with find_unused_parameters=True where usage legitimately varies per rank")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
