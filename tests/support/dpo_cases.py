"""Shared pieces of the DPO tests: a tiny Llama with LoRA at pinned parameters, one packed row of two preference pairs,
the two-sequence reference (TRL's layout: prompt+chosen and prompt+rejected as separate rows, the LoRA-disabled
model as the reference) and longdoc's shared-prefix step on a ContextParallel group.

Rank functions of the dist tests call these, so they live in a plain module (longdoc.runtime.spawn pickles by name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One packed row of two pairs and a trailing token: [prompt 7 | chosen 5 | rejected 6] [prompt 5 | chosen 1 |
# rejected 7], 32 tokens
SPANS = ((0, 7, 12, 18), (18, 23, 24, 31))
N = 32
BETA, GAMMA = 0.5, 0.3


def row(seed: int = 11) -> dict:
    from longdoc.corpus.preference_logps import IGNORE

    ids = torch.randint(0, 256, (N,), generator=torch.Generator().manual_seed(seed)).tolist()
    labels = [IGNORE] * N
    for _, c, _, e in SPANS:
        labels[c:e] = ids[c:e]
    return {"input_ids": ids, "labels": labels, "branches": [list(s) for s in SPANS]}


def lora_model(cp, strategy: str = "ring", dtype: torch.dtype = torch.float32, patched: bool = True):
    """The tiny Llama (vocabulary 256) with LoRA on q/k/v/o, every trainable parameter moved to a pinned value (so
    the policy differs from its LoRA-disabled reference), built alike in every process; unpatched if not `patched`."""
    import longdoc
    from longdoc.train.config import LoraConfig, ModelConfig, ParallelismConfig, TrainConfig
    from longdoc.train.modeling import build

    torch.manual_seed(0)
    model, _ = build(ModelConfig(name="tiny:llama", overrides={"vocab_size": 256}), LoraConfig(enabled=True, r=4),
                     TrainConfig(activation_checkpointing=False), ParallelismConfig(strategy=strategy), cp, N)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if not patched:
        longdoc.hf.unpatch(model)
    return model.to(dtype).eval()


def two_sequence(model, r: dict, loss: str, beta: float = BETA, gamma: float = GAMMA) -> dict:
    """TRL's form: each pair as two rows through the plain model, the LoRA-disabled model as reference; the loss as
    TRL writes it (mean over pairs). Leaves the gradients in the model; returns loss, (2, pairs) logps, rewards."""
    from longdoc.corpus.preference_logps import sequence_logp, two_sequence_rows

    model.zero_grad()
    pol, ref, lengths = [], [], []
    for s in two_sequence_rows(r):
        ids = torch.tensor(s["input_ids"])[None]
        pol.append(sequence_logp(model(input_ids=ids).logits[0], s["labels"]))
        with torch.no_grad(), model.disable_adapter():
            ref.append(sequence_logp(model(input_ids=ids).logits[0], s["labels"]))
        lengths.append(sum(1 for y in s["labels"] if y != -100))
    pol, ref = torch.stack(pol).view(-1, 2).T, torch.stack(ref).view(-1, 2).T  # (2, pairs): chosen, rejected
    lengths = torch.tensor(lengths, dtype=pol.dtype).view(-1, 2).T
    if loss == "sigmoid":
        ratios = pol - ref
        value = -F.logsigmoid(beta * (ratios[0] - ratios[1])).mean()
    else:
        ratios = pol / lengths
        value = -F.logsigmoid(beta * (ratios[0] - ratios[1]) - gamma).mean()
    value.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    rewards = beta * ratios.detach()
    return {"loss": value.detach().double(), "logps": pol.detach().double(), "ref": ref.double(),
            "rewards": rewards.double(), "grads": grads}


def shared_prefix(model, cp, r: dict, loss: str, beta: float = BETA, gamma: float = GAMMA, chunk: int = 5) -> dict:
    """longdoc's step on `cp`: the row sharded, the DPO share from this rank's hidden states, gradients and the loss
    summed over the group (as the trainer's DDP does)."""
    import torch.distributed as dist

    from longdoc.parallel.batch import ROW_LENGTHS
    from longdoc.parallel.batch_branches import BRANCHES
    from longdoc.parallel.layout import Branches
    from longdoc.train.dpo import DpoBatch, pair_targets, preference_losses
    from longdoc.train.loss import LossModel

    batch = {"input_ids": torch.tensor(r["input_ids"])[None], "labels": torch.tensor(r["labels"])[None],
             "branches": [Branches(tuple(tuple(s) for s in r["branches"]))]}
    local = cp.shard_batch(batch)
    targets = pair_targets(batch, cp)
    model.zero_grad()
    share, stats = LossModel(model, chunk)(local["input_ids"], local["position_ids"],
                                           cu_seq_lens=local["cu_seq_lens_q"], row_lengths=local.get(ROW_LENGTHS),
                                           branches=local[BRANCHES],
                                           dpo=DpoBatch(targets, loss, beta, gamma, len(r["branches"]), cp))
    share.backward()
    total = share.detach().double().clone()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().double().clone()
            if cp.size > 1:
                dist.all_reduce(g, group=cp.group)
            grads[n] = g
    if cp.size > 1:
        dist.all_reduce(total, group=cp.group)
    pl = preference_losses(stats[:2], stats[2:] if loss == "sigmoid" else None, targets.lengths, loss, beta, gamma)
    rewards = torch.stack([pl.chosen_rewards, pl.rejected_rewards]).double()
    return {"loss": total, "logps": stats[:2].double(), "ref": stats[2:].double(), "rewards": rewards,
            "grads": grads}


def errors(got: dict, want: dict, loss: str) -> dict[str, float]:
    """Largest relative errors: loss, log-probabilities, rewards, and over every parameter gradient."""
    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))

    out = {k: rel(got[k], want[k]) for k in ("loss", "logps", "rewards")}
    if loss == "sigmoid":
        out["ref"] = rel(got["ref"], want["ref"])
    assert set(got["grads"]) == set(want["grads"]), sorted(set(got["grads"]) ^ set(want["grads"]))[:4]
    out["grads"] = max(rel(got["grads"][n], want["grads"][n]) for n in want["grads"])
    return out
