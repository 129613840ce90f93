"""One optimizer step: `forward_backward` runs every micro-batch of this replica and reduces and clips the
gradients; `train_step` wraps it with the update, the non-finite policy, the LR schedule and the step's numbers.

Gradient scaling, exactly: each rank's loss is its SHARE, sum(its token CE) / N, where N is the number
of loss tokens in the whole optimizer step (all micro-batches, all replicas). The sum of the shares
over every rank and micro-batch is the step's token-mean loss, and the sum of their gradients is its
gradient. DDP and FSDP2 AVERAGE gradients over the world (dp x cp ranks), so each share is multiplied
by the world size before backward: the average of world_size x shares is the sum of shares.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from longdoc.hf import router
from longdoc.parallel.batch import ROW_LENGTHS
from longdoc.train.data import StepSchedule, collate, num_tokens, shard_target_weights, step_denominators
from longdoc.train.dpo_step import dpo_forward_backward
from longdoc.train.loss import base_causal_lm
from longdoc.train.run import Run
from longdoc.train.world import World


@dataclass
class StepInfo:
    step: int  # optimizer steps done (1-based after the update)
    loss: float  # token-mean loss of the step, all ranks
    lr: float
    grad_norm: float
    tokens: int  # real tokens in the step, all replicas
    step_s: float
    peak_gb: float  # this rank
    peak_gb_max: float  # the largest over all ranks
    skipped: bool
    world: World | None = field(default=None, repr=False)
    val_loss: float | None = None  # held-out token-mean loss, on steps that validated
    aux_loss: float | None = None  # MoE models: the router auxiliary loss, mean over the step's forwards
    metrics: dict[str, float] | None = None  # preference rows: TRL's rewards/* and logps/* (longdoc.train.dpo)


def train_step(run: Run, step: int, params: list[torch.Tensor]) -> tuple[StepInfo, int]:
    """Optimizer step `step` (0-based) on this rank: (its numbers, the local tokens per micro-batch). A non-finite
    loss or gradient norm skips the update, or raises FloatingPointError (train.on_nonfinite, max_skipped_steps)."""
    recipe, world, acc = run.recipe, run.world, run.world.accelerator
    run.peak.reset()
    run.logit_rows.max_rows = 0
    t0 = time.perf_counter()
    step_idx = run.schedule.step_indices(step)
    metrics = None
    if getattr(run.seqs, "has_branches", False):  # preference rows: the DPO / SimPO step
        loss, grad_norm, local_tokens, metrics = dpo_forward_backward(run, step, params)
        aux = 0.0
    else:
        loss, grad_norm, local_tokens, aux = forward_backward(acc, world, run.loss_model, params, run.seqs,
                                                              run.schedule, step, run.pad_id,
                                                              recipe.optim.max_grad_norm, run.coverage)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        run.optimizer.step()
        run.skipped_in_row = 0
    else:
        run.skipped_total += 1
        run.skipped_in_row += 1
        t = recipe.train
        if t.on_nonfinite == "abort" or run.skipped_in_row > t.max_skipped_steps:
            raise FloatingPointError(
                f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not finite"
                + ("" if t.on_nonfinite == "abort" else
                   f" for {run.skipped_in_row} steps in a row (train.max_skipped_steps)")
                + "; lower optim.lr, check the data, or use fp32 (model.dtype=float32)")
        run.say(f"warning: step {step + 1} skipped: non-finite loss {loss} or gradient norm {grad_norm} "
                f"({run.skipped_total} skipped so far)")
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    step_s = time.perf_counter() - t0
    tokens = num_tokens(run.seqs, step_idx)
    mine = run.peak.peak_gb()
    (peak_max,) = world.all_reduce([mine], dist.ReduceOp.MAX, "peak memory")
    info = StepInfo(step + 1, loss, lr, grad_norm, tokens, step_s, mine, peak_max, not finite, world)
    info.aux_loss = aux if acc.unwrap_model(run.loss_model).aux is not None and metrics is None else None
    info.metrics = metrics
    return info, local_tokens


def forward_backward(acc, world: World, loss_model, params, seqs, schedule: StepSchedule, step: int, pad_id: int,
                     max_grad_norm: float | None, coverage=None) -> tuple[float, float, int, float]:
    """Every micro-batch of this replica for optimizer `step`; gradients reduced over the world and clipped.

    Returns (the step's loss over all ranks: token-mean CE + coef x mean router aux, the global gradient norm
    before clipping, the local tokens per micro-batch on this rank, the mean router auxiliary loss or 0).
    """
    # the whole step, every replica: the denominators (sum of loss weights, number of KL tokens)
    n_loss, n_kl = step_denominators(seqs, schedule.step_indices(step))
    micro = schedule.micro_batches(step, world.dp_rank)
    loss_sum = torch.zeros((), dtype=torch.float64)
    aux_sum = torch.zeros((), dtype=torch.float64)
    # MoE router auxiliary loss: each forward's (its whole sequence's) x coef, averaged over the step's forwards;
    # every CP rank holds the same value and takes a 1/cp share
    forwards = len(micro) * world.dp_size * world.cp_size
    aux_weight = router.coefficient(base_causal_lm(acc.unwrap_model(loss_model).model)) / forwards
    local_tokens = 0
    for m, idx in enumerate(micro):
        full = collate(seqs, idx, pad_id, step)
        weights, kl = full.pop("loss_weights", None), full.pop("kl_weights", None)
        local = world.cp.shard_batch(full, pad_token_id=pad_id)
        local_tokens = int(local["input_ids"].numel())
        extra = {}
        if weights is not None:
            extra["loss_weights"] = shard_target_weights(full, weights, world.cp).to(world.device)
        # decided from the full batch, so every CP rank of the group runs the base's forward or none does
        if kl is not None and bool((kl > 0).any()):
            extra.update(kl_weights=shard_target_weights(full, kl, world.cp).to(world.device), num_kl_tokens=n_kl)
        # DDP reduces gradients once, in the backward of the last micro-batch
        sync = contextlib.nullcontext() if m == len(micro) - 1 else acc.no_sync(loss_model)
        with sync:
            cu = local.get("cu_seq_lens_q")  # packed rows: the documents' global boundaries
            lengths = local.get(ROW_LENGTHS)  # padded rows: their real lengths
            share, _ = loss_model(local["input_ids"].to(world.device), local["position_ids"].to(world.device),
                                  local["shift_labels"].to(world.device), n_loss,
                                  cu_seq_lens=cu.to(world.device) if cu is not None else None,
                                  row_lengths=lengths.to(world.device) if lengths is not None else None,
                                  aux_weight=aux_weight, **extra)
            acc.backward(share * world.world_size)  # undo DDP/FSDP's average over the world (docstring)
        if coverage is not None:  # debug_collectives: before this rank issues anything else
            coverage.check(f"step {step + 1}, micro-batch {m + 1}")
        loss_sum += share.detach().double().cpu()
        aux = acc.unwrap_model(loss_model).aux
        if aux is not None:
            aux_sum += float(aux.detach()) / forwards
    grad_norm = acc.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm) if grad_norm is not None else 0.0
    loss, aux = world.all_reduce([float(loss_sum), float(aux_sum)], dist.ReduceOp.SUM, "loss")
    return loss, grad_norm, local_tokens, aux
