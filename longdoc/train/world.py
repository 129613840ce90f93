"""Start-up of a training run: Accelerate, the (dp, cp) device mesh and the CP group.

    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml

World = dp x cp. Ranks r = dp_index * cp_size + cp_index, so a CP group is a block of consecutive
ranks: on GPUs that keeps the heavy ring traffic inside a node, and only gradients cross nodes.

Two Accelerate traps on CPU-only machines look like success and are refused here:
- `accelerate launch --cpu` / `use_cpu: true` starts ONE process (unless mpirun is set up), so a
  cp_size=2 recipe would silently train without context parallelism;
- `Accelerator()` without `cpu=True` on a machine without CUDA leaves every rank on its own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longdoc.launch import launched_world
from longdoc.train.config import Recipe, RecipeError
from longdoc.train.metrics import return_freed_memory
from longdoc.train.modeling import resolve_mixed_precision

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_size(self) -> int:
        return self.cp.size


def check_launch(recipe: Recipe, world_size: int, cuda: bool) -> tuple[int, int]:
    """(dp, cp) for a recipe launched on `world_size` processes, or a RecipeError naming the fix. Pure:
    identical on every rank."""
    cp = recipe.cp_size
    if world_size == 1 and cp > 1:
        hint = ""
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
            hint = (" This process was started with `--cpu`/`use_cpu: true`, which starts a single process "
                    "without mpirun.")
        raise RecipeError(f"cp_size={cp} needs at least {cp} processes, but this run has 1.{hint} Launch with "
                          + (f"`accelerate launch --num_processes {cp} -m longdoc train RECIPE`" if cuda
                             else CPU_LAUNCH) + ", or set cp_size=1")
    if world_size % cp:
        raise RecipeError(f"cp_size={cp} must divide the number of processes ({world_size}); use a cp_size among "
                          f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    dp = world_size // cp
    t = recipe.train
    per_step = t.micro_batch_size * dp
    if t.batch_size % per_step:
        raise RecipeError(f"train.batch_size={t.batch_size} must be a multiple of train.micro_batch_size "
                          f"({t.micro_batch_size}) x data-parallel replicas ({dp} = {world_size} processes / "
                          f"cp_size {cp}) = {per_step}")
    if t.fsdp and not cuda:
        raise RecipeError("train.fsdp=true needs CUDA GPUs (FSDP2 reduce-scatters, which gloo lacks); "
                          "set train.fsdp=false on CPU")
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
    from accelerate.utils import InitProcessGroupKwargs

    from longdoc.parallel.api import ContextParallel

    cuda = torch.cuda.is_available()
    if not cuda and recipe.train.release_freed_memory:
        return_freed_memory()  # first, so the model load and every step run under it
    expected = launched_world().world_size
    dp, cp = check_launch(recipe, expected, cuda)  # before joining anything: same error on every rank
    mixed = resolve_mixed_precision(recipe.train.mixed_precision, cuda)
    timeout = datetime.timedelta(seconds=recipe.train.comm_timeout)
    accelerator = Accelerator(
        cpu=not cuda,  # without it a CUDA-less multi-process launch leaves the ranks unjoined
        mixed_precision=mixed,
        log_with=log_with,
        project_dir=recipe.output_dir,
        fsdp_plugin=_fsdp_plugin(wrap_classes) if recipe.train.fsdp else None,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
        step_scheduler_with_optimizer=False,
    )
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"the launcher started {expected} processes but Accelerate joined {accelerator.num_processes}; "
            f"on CPU use {CPU_LAUNCH} (a `--cpu`/`use_cpu` launch is not multi-process)")
    world_size = accelerator.num_processes
    rank = accelerator.process_index
    device = accelerator.device
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        cp_group = mesh["cp"].get_group()
        if cp_group is dist.group.WORLD:
            # DDP/FSDP reduce gradients on the world group; the ring gets its own group so that its
            # point-to-point traffic never queues behind (or interleaves with) gradient reductions.
            cp_group = dist.new_group(list(range(world_size)), timeout=timeout)
        dp_rank = mesh.get_local_rank("dp")
    else:
        mesh, cp_group, dp_rank = None, None, 0
    ctx = ContextParallel(cp_group, layout=recipe.train.layout, timeout=timeout)
    return World(accelerator=accelerator, mesh=mesh, cp=ctx, world_size=world_size, rank=rank, dp_size=dp,
                 dp_rank=dp_rank, device=device, mixed_precision=mixed)

