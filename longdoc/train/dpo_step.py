"""The forward and backward of one optimizer step on preference rows (`data.task: preference`, longdoc.train.dpo):
each micro-batch of shared-prefix rows sharded with its pairs, the preference loss's share, and the step's
TRL-named metrics, identical on every rank.

The loss of a step is the mean over its pairs (every micro-batch, every data-parallel replica) of each pair's
loss; each micro-batch's share divides its pairs' losses by that count (and by cp: every CP rank holds the same
sums), so summed over ranks and micro-batches the shares are the step's loss, and longdoc/train/step.py's scaling
of the backward applies unchanged.

The reference (sigmoid DPO): the LoRA-disabled model run under no_grad on the same sharded batch, inside the
wrapped forward (as the KL term of longdoc.train.mix). `ReferenceCache` keeps each row's reference sums after its
first forward, keyed by the row's index in the training rows (fixed for the run), so a row seen again skips the
reference forward. Valid because the base never changes (LoRA trains adapters only) and runs without dropout in
its adapters; a resumed run starts with an empty cache and fills it again. Every CP rank holds the same rows and
the same sums, so every rank of a group runs the reference forward or none does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from longdoc.parallel.batch import ROW_LENGTHS
from longdoc.parallel.batch_branches import BRANCHES
from longdoc.train.data import IGNORE
from longdoc.train.dpo import DpoBatch, metric_sums, metrics_of, pair_targets, preference_losses


def spans(seqs, i: int) -> list[list[int]]:
    """Row i's pairs: [prompt_start, chosen_start, rejected_start, end] each."""
    return [[int(x) for x in s] for s in seqs.ds[int(i)]["branches"]]


def step_pairs(seqs, indices) -> int:
    """The pairs of these rows: the denominator of the step's mean loss."""
    return sum(len(spans(seqs, i)) for i in indices)


def collate_pairs(seqs, indices, pad_id: int) -> dict:
    """Full micro-batch of preference rows: right-padded input_ids and unshifted labels, the attention_mask where a
    row is padded, and each row's pairs (cp.shard_batch computes their position ids)."""
    rows = [seqs.row(i) for i in indices]
    length = max(x.numel() for x, _ in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        ids[r, :x.numel()], labels[r, :y.numel()], mask[r, :x.numel()] = x, y, 1
    batch = {"input_ids": ids, "labels": labels, "branches": [spans(seqs, i) for i in indices]}
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    return batch


class ReferenceCache:
    """Each row's (2, pairs) reference log-probability sums, float64 on the host, by row index (module doc)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.rows: dict[int, torch.Tensor] = {}

    def get(self, indices) -> torch.Tensor | None:
        if not self.enabled or any(int(i) not in self.rows for i in indices):
            return None
        return torch.cat([self.rows[int(i)] for i in indices], dim=1)

    def put(self, indices, counts: list[int], reference: torch.Tensor) -> None:
        if self.enabled:
            for i, part in zip(indices, reference.detach().double().cpu().split(counts, dim=1)):
                self.rows[int(i)] = part


def dpo_forward_backward(run, step: int, params) -> tuple[float, float, int, dict[str, float]]:
    """Every micro-batch of this replica for optimizer `step` on preference rows; gradients reduced and clipped.
    Returns (the step's mean preference loss over all ranks, the global gradient norm before clipping, the local
    tokens per micro-batch, the step's metrics)."""
    acc, world, cfg, loss_model = run.world.accelerator, run.world, run.recipe.preference, run.loss_model
    n_pairs = step_pairs(run.seqs, run.schedule.step_indices(step))
    micro = run.schedule.micro_batches(step, world.dp_rank)
    loss_sum = torch.zeros((), dtype=torch.float64)
    sums = torch.zeros(7, dtype=torch.float64)
    local_tokens = 0
    for m, idx in enumerate(micro):
        full = collate_pairs(run.seqs, idx, run.pad_id)
        local = world.cp.shard_batch(full, pad_token_id=run.pad_id)
        local_tokens = int(local["input_ids"].numel())
        targets = pair_targets(full, world.cp)
        cached = run.reference_cache.get(idx) if cfg.loss == "sigmoid" else None
        dpo = DpoBatch(targets, cfg.loss, cfg.beta, cfg.gamma, n_pairs, world.cp, cached)
        lengths = local.get(ROW_LENGTHS)
        sync = contextlib.nullcontext() if m == len(micro) - 1 else acc.no_sync(loss_model)
        with sync:
            share, stats = loss_model(local["input_ids"].to(world.device), local["position_ids"].to(world.device),
                                      cu_seq_lens=local["cu_seq_lens_q"].to(world.device),
                                      row_lengths=lengths.to(world.device) if lengths is not None else None,
                                      branches=local[BRANCHES].to(world.device), dpo=dpo)
            acc.backward(share * world.world_size)  # undo DDP/FSDP's average over the world (longdoc/train/step.py)
        if run.coverage is not None:
            run.coverage.check(f"step {step + 1}, micro-batch {m + 1}")
        stats = stats.detach().double().cpu()
        if cfg.loss == "sigmoid" and cached is None:
            run.reference_cache.put(idx, [len(b) for b in full["branches"]], stats[2:])
        pl = preference_losses(stats[:2], stats[2:] if cfg.loss == "sigmoid" else None, targets.lengths, cfg.loss,
                               cfg.beta, cfg.gamma)
        sums += metric_sums(pl)
        loss_sum += share.detach().double().cpu()
    grad_norm = acc.clip_grad_norm_(params, run.recipe.optim.max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm) if grad_norm is not None else 0.0
    loss, *totals = world.all_reduce([float(loss_sum), *sums.tolist()], dist.ReduceOp.SUM, "loss")
    # every CP rank of a replica counted the same pairs
    return loss, grad_norm, local_tokens, metrics_of([t / world.cp_size for t in totals], n_pairs)
