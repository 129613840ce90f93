"""The process groups of a dp x cp run: one per stream of collectives, and DDP's reduction moved onto its own.

    groups = make_groups(dp, cp, "cpu", timeout)           # every rank, right after the world is joined
    cp = ContextParallel(groups.cp, debug_collectives=...)
    ddp_model = accelerator.prepare(model)                  # DDP (Accelerate, Trainer or by hand)
    reduce_gradients_on(ddp_model, groups.grads, groups.guard("grads"))

Why (issue 22): gloo and NCCL match the n-th collective of a group on one rank with the n-th on the others.
Two streams that share a group stay matched only if every rank interleaves them identically, and DDP's
bucket all-reduces are issued from autograd hooks, at moments that depend on each rank's own graph. Full
fine-tuning with answer-only loss under zigzag CP left a rank without loss tokens; its lm_head got no
gradient, its DDP buckets never fired, and its next collective on the world group (the loop's loss sum,
8 bytes) met a peer's gradient bucket (1 MB): a gloo abort, or, had the sizes agreed, two messages silently
mixed. So the order of collectives is made right BY CONSTRUCTION, not by timing:

1. Each stream gets a group nobody else issues on:
   - cp:      the CP ring, all-gathers and the small agreement checks inside forward/backward
              (ContextParallel); issued in layer order by every rank of the CP group.
   - grads:   DDP's bucket all-reduces only (a comm hook moves them off DDP's own group, the world group,
              which stays to Accelerate/Trainer's main-thread collectives: barriers, gathers, checkpoints).
   - scalars: the loop's step-level sums (loss, peak memory, validation loss) over the world.
   - dp:      across the replicas (same CP index): CPTrainer's loss-token count.
   Under FSDP2 (GPU) the reduce-scatters and all-gathers stay on FSDP's mesh group (the world group, which
   Accelerate gives it); longdoc issues nothing on it, and everything else that does runs on the main
   thread after backward, when FSDP2's final callback has issued all of its own.
2. Within a stream the order is the same on every rank only if every rank runs the same backward: every
   trainable parameter gets a gradient on every rank in every backward. longdoc's chunked loss keeps the
   head in the graph with a zero-weighted term when a rank holds no loss token (longdoc.train.loss); the
   patched model's own loss computes every local token's logits. DDP buckets then fire in index order on
   every rank. transformers 5 fuses MoE experts into one parameter per layer, so routing does not change
   which parameters are used; a model whose usage does vary per rank needs DDP's
   find_unused_parameters=True. `debug_collectives` (longdoc.parallel.guard) checks both facts at run time.

Explicit gradient reduction after backward (no DDP) would also be safe, but it gives up the overlap of
reduction with backward, and Accelerate/Trainer own the wrapping; a dedicated group via a comm hook keeps both.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from longdoc.parallel.guard import Guard


@dataclass
class Groups:
    """One group per stream (see the module docstring); None on one process."""

    mesh: Any  # torch DeviceMesh with axes ("dp", "cp"), or None
    cp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    grads: dist.ProcessGroup | None
    scalars: dist.ProcessGroup | None
    dp_rank: int = 0
    timeout: datetime.timedelta | None = None
    guards: dict[str, Guard] = field(default_factory=dict)  # debug_collectives: a Guard per group name

    def guard(self, name: str) -> Guard | None:
        return self.guards.get(name)


def _own(group: dist.ProcessGroup, ranks: list[int], timeout) -> dist.ProcessGroup:
    # DeviceMesh hands out the default (world) group for a dimension that spans the world; that group is
    # DDP's and Accelerate's, so such a stream gets a fresh one over the same ranks.
    if group is dist.group.WORLD:
        return dist.new_group(ranks, **({"timeout": timeout} if timeout is not None else {}))
    return group


def make_groups(dp: int, cp: int, device_type: str, timeout: datetime.timedelta | None = None,
                debug_collectives: bool = False, fsdp: bool = False) -> Groups:
    """Build the ("dp", "cp") mesh (ranks r = dp_index * cp + cp_index: a CP group is consecutive ranks, so
    the heavy ring traffic stays inside a node) and a group per stream. Collective: every rank calls it once,
    in the same order. fsdp: FSDP2 reduces on its own mesh, so no grads group is made."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Groups(None, None, None, None, None, 0, timeout)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"dp ({dp}) x cp ({cp}) must equal the world size ({world})")
    everyone = list(range(world))
    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group = _own(mesh["cp"].get_group(), everyone, timeout)
    dp_group = _own(mesh["dp"].get_group(), everyone, timeout)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    grads = None if fsdp else dist.new_group(everyone, **kwargs)
    scalars = dist.new_group(everyone, **kwargs)
    groups = Groups(mesh, cp_group, dp_group, grads, scalars, mesh.get_local_rank("dp"), timeout)
    if debug_collectives:  # the CP group's guard belongs to its ContextParallel (debug_collectives=True)
        for name in ("dp", "grads", "scalars"):
            g = getattr(groups, name)
            if g is not None and dist.get_world_size(g) > 1:
                groups.guards[name] = Guard(g, name, timeout)
    return groups


def all_reduce(values: list[float], op: dist.ReduceOp, group: dist.ProcessGroup | None, device: torch.device,
               guard: Guard | None = None, what: str = "scalars") -> list[float]:
    """Step-level scalars summed (or max-ed) over `group`, in float64; unchanged on one process."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if guard is not None:
        guard.check(f"all_reduce {what}", t.numel() * t.element_size())
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


class _HookState:
    def __init__(self, group: dist.ProcessGroup, guard: Guard | None):
        self.group, self.guard = group, guard


def _reduce_bucket(state, bucket):
    # torch's own allreduce hook (average over the group, what DDP does built in), on the dedicated group. No
    # annotations: DDP compares them with dist.GradBucket, and `from __future__ import annotations` makes strings.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state.guard is not None:
        buf = bucket.buffer()
        state.guard.check(f"ddp bucket {bucket.index()} all_reduce ({buf.numel()} x {buf.dtype})",
                          buf.numel() * buf.element_size())
    return default_hooks.allreduce_hook(state.group, bucket)


def reduce_gradients_on(model: torch.nn.Module, group: dist.ProcessGroup | None, guard: Guard | None = None) -> bool:
    """Make a DDP-wrapped model all-reduce its gradient buckets on `group` (averaged over it, as DDP does).

    Call before the first backward. Returns False (and does nothing) when `model` is not DDP (one process,
    FSDP2) or `group` is None."""
    from torch.nn.parallel import DistributedDataParallel

    if group is None or not isinstance(model, DistributedDataParallel):
        return False
    model.register_comm_hook(_HookState(group, guard), _reduce_bucket)
    return True
