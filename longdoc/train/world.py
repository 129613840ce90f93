"""Start-up of a training run: Accelerate, the (dp, cp) device mesh and the CP group.

    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml

World = dp x cp. Ranks r = dp_index * cp_size + cp_index, so a CP group is a block of consecutive
ranks: on GPUs that keeps the heavy ring traffic inside a node, and only gradients cross nodes.

Process groups: one per stream of collectives, so that no two streams that may run at the same time ever
share one (longdoc.parallel.groups says why and how; issue 22 is what sharing did):
  cp      - the CP ring, all-gathers and agreement checks (World.cp, a ContextParallel);
  grads   - DDP's bucket all-reduces, moved there by a comm hook (`reduce_gradients`); FSDP2 keeps its mesh;
  scalars - the loop's loss / peak-memory / validation sums (World.all_reduce);
  world   - Accelerate's own main-thread collectives (barriers, gathers, checkpoints), and DDP's.
The design is "own group per stream + every trainable parameter in every rank's loss graph", rather than
reducing gradients by hand after backward: DDP keeps overlapping the reduction with backward. With
`train.debug_collectives` (or LONGDOC_DEBUG_COLLECTIVES=1) every collective longdoc issues on these groups
is first checked across its group by sequence number and op tag (longdoc.parallel.guard).

Two Accelerate traps on CPU-only machines look like success and are refused here:
- `accelerate launch --cpu` / `use_cpu: true` starts ONE process (unless mpirun is set up), so a
  parallelism.cp_size=2 recipe would silently train without context parallelism;
- `Accelerator()` without `cpu=True` on a machine without CUDA leaves every rank on its own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longdoc.parallel.groups import Groups, all_reduce, make_groups, reduce_gradients_on
from longdoc.parallel.guard import GradCoverage, debug_collectives_from_env
from longdoc.runtime.launch import launched_world
from longdoc.train.config import Recipe, RecipeError
from longdoc.train.metrics import return_freed_memory
from longdoc.train.modeling import resolve_mixed_precision
from longdoc.train.peers import PeerWatch

CPU_LAUNCH = ("accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train RECIPE "
              "(or: accelerate launch --multi_gpu --num_processes N -m longdoc train RECIPE)")


@dataclass
class World:
    accelerator: Any  # accelerate.Accelerator
    mesh: Any  # torch DeviceMesh with axes ("dp", "cp"), or None for one process
    cp: Any  # longdoc.ContextParallel over mesh["cp"]
    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    mixed_precision: str
    groups: Groups | None = None
    debug_collectives: bool = False
    peers: PeerWatch | None = None  # lost-peer detection (longdoc.train.peers); None on one process
    fsdp: bool = False  # parallelism.fsdp in effect: asked for, over more than one process (`shards`)
    shard_on_cpu: bool = False  # parallelism.fsdp on CPU: the loop applies FSDP2 itself (shard_state), not Accelerate

    def close(self, finished: bool = True) -> None:
        """The end of this rank's run: stop the peer watch (`finished`: tell the peers this rank is done)."""
        if self.peers is not None:
            self.peers.close(finished)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_size(self) -> int:
        return self.cp.size

    def all_reduce(self, values: list[float], op=dist.ReduceOp.SUM, what: str = "scalars") -> list[float]:
        """Step-level scalars reduced over every rank, on the scalars group (float64)."""
        g = self.groups
        if g is None or g.scalars is None:
            return values
        return all_reduce(values, op, g.scalars, self.device, g.guard("scalars"), what)

    def shard_state(self, loss_model: torch.nn.Module) -> torch.nn.Module:
        """parallelism.fsdp on CPU: FSDP2 (fully_shard) over all dp x cp ranks on gloo, each decoder layer a unit and
        the rest (embeddings, head, norm) the root's, so weights, gradients and AdamW moments are 1/world per rank
        instead of replicated. Its own 1-D mesh (a new process group): FSDP's all-gathers and reduce-scatters,
        issued from autograd hooks, never share a group with the CP ring or the scalar reductions. Before the
        optimizer is built: fully_shard replaces the parameters."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("shard",))
        units = set(getattr(loss_model, "_no_split_modules", None) or ())
        for module in list(loss_model.modules()):
            if type(module).__name__ in units:
                fully_shard(module, mesh=mesh)
        fully_shard(loss_model, mesh=mesh)
        return loss_model

    def prepare(self, loss_model: torch.nn.Module, make_optimizer) -> tuple[torch.nn.Module, Any]:
        """(model, optimizer) ready to train: Accelerate's prepare (DDP, or FSDP2 on GPUs). parallelism.fsdp on CPU:
        shard_state first (the optimizer then holds the shards), the optimizer alone through Accelerate, and the
        forward under its autocast, as its prepare would have wrapped it; never DDP around the sharded model."""
        acc = self.accelerator
        if not self.shard_on_cpu:
            return acc.prepare(loss_model, make_optimizer(loss_model))
        loss_model = self.shard_state(loss_model)
        optimizer = acc.prepare(make_optimizer(loss_model))
        forward = loss_model.forward

        def autocast_forward(*args, **kwargs):
            with acc.autocast():
                return forward(*args, **kwargs)

        loss_model.forward = autocast_forward
        return loss_model, optimizer

    @staticmethod
    def full_state_dict(loss_model: torch.nn.Module) -> dict:
        """The full weights gathered from FSDP2 shards, on the CPU (a collective: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(loss_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def reduce_gradients(self, model: torch.nn.Module) -> GradCoverage | None:
        """After accelerator.prepare: DDP reduces on the grads group. In debug mode under DDP, returns the
        check that every trainable parameter gets a gradient in every backward (call .check after each);
        FSDP2 (sharded DTensor parameters) relies on the loss's construction alone."""
        g = self.groups
        if g is None or not reduce_gradients_on(model, g.grads, g.guard("grads")):
            return None
        # The models' buffers (rotary tables) are constants DDP copied from rank 0 when it wrapped the
        # model; re-broadcasting them in every forward would be one more collective on DDP's group.
        model.broadcast_buffers = False
        return GradCoverage(model.named_parameters()) if self.debug_collectives else None


def shards(recipe: Recipe, world_size: int) -> bool:
    """Whether the recipe's parallelism.fsdp shards anything on `world_size` processes. One process has nothing to shard
    (and on CPU without a launcher FSDP's mesh would fail, wanting the launcher's RANK for an env:// rendezvous),
    so there it trains as a plain single process. Pure: identical on every rank."""
    return recipe.parallelism.fsdp and world_size > 1


def check_launch(recipe: Recipe, world_size: int, cuda: bool) -> tuple[int, int]:
    """(dp, cp) for a recipe launched on `world_size` processes, or a RecipeError naming the fix. Pure:
    identical on every rank."""
    cp = recipe.parallelism.cp_size
    if world_size == 1 and cp > 1:
        hint = ""
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
            hint = (" This process was started with `--cpu`/`use_cpu: true`, which starts a single process "
                    "without mpirun.")
        raise RecipeError(f"parallelism.cp_size={cp} needs at least {cp} processes, but this run has 1.{hint} "
                          "Launch with " + (f"`accelerate launch --num_processes {cp} -m longdoc train RECIPE`"
                                            if cuda else CPU_LAUNCH) + ", or set parallelism.cp_size=1")
    if world_size % cp:
        raise RecipeError(f"parallelism.cp_size={cp} must divide the number of processes ({world_size}); use a "
                          f"cp_size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    dp = world_size // cp
    t = recipe.train
    per_step = t.micro_batch_size * dp
    if t.batch_size % per_step:
        raise RecipeError(f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel replicas ({dp} = {world_size} processes / "
                          f"parallelism.cp_size {cp}) = {per_step}")
    return dp, cp


def _fsdp_plugin(wrap_classes: list[str] | None):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=wrap_classes,
        state_dict_type="SHARDED_STATE_DICT",
        # activation checkpointing is transformers' own (model.gradient_checkpointing_enable)
        activation_checkpointing=False,
        cpu_ram_efficient_loading=False,
    )


def start(recipe: Recipe, log_with: list | None = None, wrap_classes: list[str] | None = None) -> World:
    """Create the Accelerator, check the launch, build the mesh and the CP group."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from longdoc.parallel.api import ContextParallel

    cuda = torch.cuda.is_available()
    if not cuda and recipe.train.release_freed_memory:
        return_freed_memory()  # first, so the model load and every step run under it
    launched = launched_world()
    expected = launched.world_size
    dp, cp = check_launch(recipe, expected, cuda)  # before joining anything: same error on every rank
    fsdp = shards(recipe, expected)
    if recipe.parallelism.fsdp and not fsdp:
        print("longdoc train: parallelism.fsdp=true on one process: nothing to shard, so it trains as one plain "
              "process (FSDP shards over 2 or more)", flush=True)
    mixed = resolve_mixed_precision(recipe.train.mixed_precision, cuda)
    timeout = datetime.timedelta(seconds=recipe.train.comm_timeout)
    accelerator = Accelerator(
        cpu=not cuda,  # without it a CUDA-less multi-process launch leaves the ranks unjoined
        mixed_precision=mixed,
        log_with=log_with,
        project_dir=recipe.output_dir,
        # Accelerate applies its FSDP plugin to GPU devices only; on CPU the loop shards with fully_shard itself
        fsdp_plugin=_fsdp_plugin(wrap_classes) if fsdp and cuda else None,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)] + (
            [] if recipe.train.ddp_bucket_cap_mb is None
            else [DistributedDataParallelKwargs(bucket_cap_mb=recipe.train.ddp_bucket_cap_mb)]),
        step_scheduler_with_optimizer=False,
    )
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"the launcher started {expected} processes but Accelerate joined {accelerator.num_processes}; "
            f"on CPU use {CPU_LAUNCH} (a `--cpu`/`use_cpu` launch is not multi-process)")
    world_size = accelerator.num_processes
    rank = accelerator.process_index
    device = accelerator.device
    debug = recipe.train.debug_collectives or debug_collectives_from_env()
    groups = make_groups(dp, cp, device.type, timeout, debug_collectives=debug, fsdp=fsdp)
    # usp: ContextParallel factors the CP group into its "cp_ring" x "cp_ulysses" axes (collective over the group)
    ctx = ContextParallel(groups.cp, layout=recipe.parallelism.layout, timeout=timeout, debug_collectives=debug,
                          ulysses_size=recipe.parallelism.ulysses_size)
    # across nodes only: inside one node the launcher itself stops every rank when one dies
    peers = PeerWatch(rank, world_size, recipe.train.peer_timeout, node=launched.node) if launched.nodes > 1 else None
    return World(fsdp=fsdp, shard_on_cpu=fsdp and not cuda,
                 accelerator=accelerator, mesh=groups.mesh, cp=ctx, world_size=world_size, rank=rank, dp_size=dp,
                 dp_rank=groups.dp_rank, device=device, mixed_precision=mixed, groups=groups,
                 debug_collectives=debug, peers=peers)

