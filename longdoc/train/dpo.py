"""Preference tuning (DPO, SimPO) on shared-prefix rows under context parallelism: each rank's part of every pair's
chosen and rejected log-probability, summed over the CP group, and the preference losses as TRL defines them.

    local = cp.shard_batch(full_batch)                        # input_ids, labels, branches (one row of spans each)
    targets = pair_targets(full_batch, cp)                    # which local logit predicts which answer token
    dpo = DpoBatch(targets, "sigmoid", beta, 0.0, pairs_in_the_step, cp)
    share, stats = loss_model(local["input_ids"], local["position_ids"], cu_seq_lens=local["cu_seq_lens_q"],
                              branches=local["longdoc_branches"], dpo=dpo)   # LossModel, longdoc.train.loss

A row is [prompt | chosen | rejected] per pair (longdoc.corpus.preference). The prompt's last position predicts
two tokens, chosen's first AND rejected's first, so no shifted label vector holds every target; cp.shard_batch's
shift_labels drop rejected's first. `pair_targets` lists every answer token with the GLOBAL position whose logit
predicts it (branch_targets: t - 1, except rejected's first -> the prompt's last) and keeps those whose predicting
position lies on this rank (cp.shard_batch's own layout, through source_index): the extra target is taken on
whichever rank holds the prompt's last position, with no special case, and padding predicts nothing.

Each rank sums the log-probabilities of its targets per pair and side (`answer_logps`, chunked like the SFT head:
never (tokens x vocab) logits at once); `cp.sum` (a differentiable all-reduce: its backward sums the ranks'
gradients) gives every rank the whole sequences' sums. Every rank then computes the same loss, the mean over the
pairs of the optimizer step, and returns loss / cp as its share: summed over the group, the gradients are the
one-process gradients (longdoc/train/step.py undoes DDP's average the same way as for the SFT loss).

Losses (`loss:` of the recipe's `preference:` section):
  sigmoid  DPO (TRL 1.16.0 DPOTrainer, loss_type="sigmoid", label_smoothing 0): with log-ratios
           c = logp(chosen) - ref_logp(chosen), r likewise, loss = -logsigmoid(beta (c - r)), rewards beta c and
           beta r. The reference is the model with its LoRA adapters disabled (no second copy of the weights), run
           under no_grad on the same sharded batch; its sums per row are constant (the base is frozen), so the
           trainer caches them by row (longdoc.train.dpo_step.ReferenceCache).
  simpo    SimPO (TRL 1.16.0 CPOTrainer, loss_type="simpo", cpo_alpha 0): length-normalised log-probabilities
           c = logp(chosen) / |chosen|, r likewise, loss = -logsigmoid(beta (c - r) - gamma), rewards beta c and
           beta r. The reference-free variant offered: it needs no reference forward at all (the cheapest on long
           documents, where one forward is most of a step) and works with full fine-tuning; ORPO, the other common
           one, adds an SFT term on chosen and an odds ratio, a second objective over the same tokens.
Metrics, named as TRL logs them, means over the step's pairs and identical on every rank: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (summed log-probabilities for
sigmoid; per-token means for simpo, as TRL's CPOTrainer logs them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from longdoc.corpus.preference_logps import branch_targets
from longdoc.hf.head import LogitHead
from longdoc.parallel.batch import source_index
from longdoc.parallel.batch_branches import per_row

LOSSES = ("sigmoid", "simpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class PairTargets(NamedTuple):
    """This rank's answer tokens: the local logit that predicts each, and where its log-probability is summed."""

    logit: torch.Tensor  # (n,) flat index into the local (batch * local_len) positions of the predicting logit
    token: torch.Tensor  # (n,) the predicted token id
    slot: torch.Tensor  # (n,) side * pairs + pair: row 0 chosen, row 1 rejected of the (2, pairs) sums
    lengths: torch.Tensor  # (2, pairs) float64: every pair's chosen and rejected token counts (whole sequence)


def pairs_of(batch: dict[str, Any]) -> list[list[tuple[int, int, int, int]]]:
    """Each row's (prompt_start, chosen_start, rejected_start, end) spans; rows without pairs give []."""
    ids = torch.as_tensor(batch["input_ids"])
    ids = ids[None] if ids.dim() == 1 else ids
    return [list(b.spans) if b is not None else [] for b in per_row(batch["branches"], ids.shape[0])]


def pair_targets(batch: dict[str, Any], cp: Any) -> PairTargets:
    """The targets of the full batch `batch` (input_ids, branches, optional attention_mask for right padding)
    that this rank of `cp` predicts, laid out as cp.shard_batch(batch) lays out the tokens."""
    ids = torch.as_tensor(batch["input_ids"]).long()
    ids = ids[None] if ids.dim() == 1 else ids
    rows = pairs_of(batch)
    src = source_index({k: batch[k] for k in ("input_ids", "attention_mask", "branches") if k in batch}, cp)
    bsz, local_len = src.shape
    local_of = torch.full(ids.shape, -1, dtype=torch.long)  # global (row, position) -> flat local index
    b, j = torch.nonzero(src >= 0, as_tuple=True)
    local_of[b, src[b, j]] = b * local_len + j
    n_pairs = sum(len(r) for r in rows)
    index, token, slot, lengths, first = [], [], [], torch.zeros(2, n_pairs, dtype=torch.float64), 0
    for r, spans in enumerate(rows):
        if not spans:
            continue
        t = branch_targets({"input_ids": ids[r], "branches": spans})
        where = local_of[r, t.logit_index]
        keep = where >= 0
        index.append(where[keep])
        token.append(ids[r, t.target_index[keep]])
        slot.append(t.rejected[keep].long() * n_pairs + first + t.pair[keep])
        for k, (_, c, rj, e) in enumerate(spans):
            lengths[:, first + k] = torch.tensor([rj - c, e - rj], dtype=torch.float64)
        first += len(spans)
    empty = torch.zeros(0, dtype=torch.long)
    return PairTargets(torch.cat(index) if index else empty, torch.cat(token) if token else empty,
                       torch.cat(slot) if slot else empty, lengths)


def _chunk_logp(head: LogitHead, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (chunk, hidden) -> (chunk,) log p(y); the log-softmax in at least fp32 (a DPO margin is a small difference)
    logits = head(h)
    return -F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), y, reduction="none")


def answer_logps(head: LogitHead, hidden: torch.Tensor, targets: PairTargets, chunk_tokens: int) -> torch.Tensor:
    """(2, pairs): this rank's summed log-probabilities of chosen (row 0) and rejected (row 1) per pair, from its
    final hidden states (batch, local_len, hidden), `chunk_tokens` targets through the head at a time."""
    n_pairs = targets.lengths.shape[1]
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    sums = hidden.new_zeros(2 * n_pairs, dtype=dtype)
    index, token, slot = (t.to(hidden.device) for t in targets[:3])
    if index.numel() == 0:
        # no target on this rank: the same backward as its peers through body and head (see head.chunked_ce_sum)
        return (sums + 0.0 * hidden.sum() + 0.0 * head(h[:1]).sum()).view(2, n_pairs)
    for start in range(0, index.numel(), chunk_tokens):
        hc, yc = h[index[start:start + chunk_tokens]], token[start:start + chunk_tokens]
        if torch.is_grad_enabled() and hc.requires_grad:
            logp = checkpoint(_chunk_logp, head, hc, yc, use_reentrant=False)
        else:
            logp = _chunk_logp(head, hc, yc)
        sums = sums.index_add(0, slot[start:start + chunk_tokens], logp.to(dtype))
    return sums.view(2, n_pairs)


class PairLosses(NamedTuple):
    losses: torch.Tensor  # (pairs,) differentiable
    chosen_rewards: torch.Tensor  # (pairs,) detached
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # (pairs,) detached, as TRL logs them (summed, or per token for simpo)
    rejected_logps: torch.Tensor


def preference_losses(logps: torch.Tensor, reference: torch.Tensor | None, lengths: torch.Tensor, loss: str,
                      beta: float, gamma: float = 0.0) -> PairLosses:
    """Per-pair losses and rewards (module docstring) from the (2, pairs) summed log-probabilities of the policy,
    those of the reference (sigmoid only) and the (2, pairs) answer lengths."""
    if loss == "sigmoid":
        if reference is None:
            raise ValueError("the sigmoid DPO loss needs the reference log-probabilities")
        ratios = logps - reference.to(logps)
        losses = -F.logsigmoid(beta * (ratios[0] - ratios[1]))
        shown = logps
    elif loss == "simpo":
        ratios = logps / lengths.to(logps)
        losses = -F.logsigmoid(beta * (ratios[0] - ratios[1]) - gamma)
        shown = ratios
    else:
        raise ValueError(f"preference.loss must be one of {LOSSES}, got {loss!r}")
    rewards = beta * ratios.detach()
    return PairLosses(losses, rewards[0], rewards[1], shown[0].detach(), shown[1].detach())


def metric_sums(p: PairLosses) -> torch.Tensor:
    """(1 + len(METRICS),) float64 sums over the pairs: the loss, then each metric; divide by the pairs counted."""
    c, r = p.chosen_rewards.double(), p.rejected_rewards.double()
    parts = [p.losses.detach().double(), c, r, c - r, (c > r).double(), p.chosen_logps.double(),
             p.rejected_logps.double()]
    return torch.stack([x.sum() for x in parts]).cpu()


def metrics_of(sums: list[float], n_pairs: int) -> dict[str, float]:
    """The TRL-named metrics of the step from `metric_sums` added over its micro-batches and ranks."""
    return {name: float(v) / max(n_pairs, 1) for name, v in zip(METRICS, sums[1:])}


class DpoBatch:
    """What LossModel.forward needs for a preference micro-batch: a plain object (DDP passes it through as is).

    targets: pair_targets of the full micro-batch on this rank; loss, beta, gamma: the preference loss;
    num_pairs: the pairs of the whole optimizer step (every micro-batch and replica), the mean's denominator;
    cp: the ContextParallel group whose sum gives the whole sequences' log-probabilities; reference: the (2, pairs)
    reference sums when known (cached), None to compute them (sigmoid) or for simpo."""

    __slots__ = ("targets", "loss", "beta", "gamma", "num_pairs", "cp", "reference")

    def __init__(self, targets: PairTargets, loss: str, beta: float, gamma: float, num_pairs: int, cp: Any,
                 reference: torch.Tensor | None = None):
        self.targets, self.loss, self.beta, self.gamma = targets, loss, beta, gamma
        self.num_pairs, self.cp, self.reference = num_pairs, cp, reference


def dpo_share(loss_model: Any, hidden: torch.Tensor, dpo: DpoBatch, base_hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share of the step's preference loss, stats): stats (4, pairs) detached, policy chosen and
    rejected sums then the reference's (zeros for simpo). `base_hidden()` gives the reference's final hidden
    states (called under no_grad with the adapters disabled) when dpo.reference is None and the loss needs one."""
    head, chunk = loss_model.head, loss_model.chunk_tokens
    logps = dpo.cp.sum(answer_logps(head, hidden, dpo.targets, chunk))
    reference = dpo.reference
    if dpo.loss == "sigmoid" and reference is None:
        with torch.no_grad(), loss_model.base():
            reference = dpo.cp.sum(answer_logps(loss_model.head, base_hidden(), dpo.targets, chunk))
    pl = preference_losses(logps, reference, dpo.targets.lengths, dpo.loss, dpo.beta, dpo.gamma)
    share = pl.losses.sum() / (max(int(dpo.num_pairs), 1) * dpo.cp.size)
    ref = reference.detach().to(logps) if reference is not None else torch.zeros_like(logps)
    return share, torch.cat([logps.detach(), ref])
