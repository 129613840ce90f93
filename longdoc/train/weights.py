"""Per-token weights of training mixes (`data.mix`, longdoc.train.mix): how a source's tokens count, the context
positions drawn when a source computes its document loss and KL at a few of them, and the weights' layout on
a CP rank.

A drawn subset stands for every context token of its row: each of the N context positions is drawn with
probability n / N and weighted N / n, so the document loss sum(w * CE) and the KL sum(k * KL) of a step are
unbiased estimates of the full ones while their denominators (longdoc.train.data.step_denominators) count every
context token. The draw is a pure function of (recipe seed, source, row, optimizer step), made on the full row
before CP sharding: every CP rank and every cp size uses the same positions, and a resumed run draws them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenWeights:
    """How a source's tokens count (a `data.mix` source; the defaults are plain training rows).

    loss: weight of the row's own targets (answers of QA rows, every token of LM rows); document: weight of
    the document tokens of QA rows (`doc_span`), which then become targets too; kl: weight of KL(base ||
    tuned) on the context tokens (QA rows: the document; LM rows: every target); context_positions: in
    training, the document loss and the KL at only this many context positions per row (`draw_context`)."""

    loss: float = 1.0
    document: float = 0.0
    kl: float = 0.0
    context_positions: int | None = None

    @property
    def plain(self) -> bool:
        return self == TokenWeights()


_MASK64 = (1 << 64) - 1


def _key_seed(key: Sequence[int]) -> int:
    # splitmix64 over the key's integers: stable across processes and Python versions (hash() of a tuple is not
    # promised to be), so every CP rank, any cp size and a resumed run seed the same draw
    h = 0
    for k in key:
        h = (h + 0x9E3779B97F4A7C15 + (int(k) & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def draw_context(counted: torch.Tensor, n: int, key: Sequence[int]) -> torch.Tensor:
    """Weight factors that keep `n` of the `counted` positions (bool (len,)), drawn uniformly without
    replacement by a generator seeded from `key` alone (a pure function of it).

    Returns (len,) float64: N / n at the drawn positions (N = counted.sum()), 0 at the other counted ones, 1
    elsewhere; all 1 when N <= n. Every counted position is drawn with probability n / N, so E[factor] = 1 there:
    a sum over them weighted by the factors is an unbiased estimate of the full sum, and the factors sum to N
    (up to float64 rounding), so a constant weight's total is kept."""
    factor = torch.ones(counted.shape, dtype=torch.float64)
    where = counted.nonzero().flatten()
    total = int(where.numel())
    if total <= n:
        return factor
    g = torch.Generator().manual_seed(_key_seed(key))
    drawn = where[torch.randperm(total, generator=g)[:n]]
    factor[where] = 0.0
    factor[drawn] = total / n
    return factor


def shard_target_weights(batch: dict[str, torch.Tensor], weights: torch.Tensor, cp) -> torch.Tensor:
    """(batch, local_len) float: per-token `weights` of a full collated batch (aligned with its unshifted
    labels) shifted as cp.shard_batch shifts the labels and laid out as its tokens, so weight[t] goes with
    shift_labels[t]; 0 on the internal padding and at a packed document's last token (it predicts nothing)."""
    from longdoc.parallel.batch import source_index

    shifted = torch.zeros_like(weights)
    shifted[:, :-1] = weights[:, 1:]
    if "position_ids" in batch:
        shifted[:, :-1].masked_fill_(batch["position_ids"][:, 1:] == 0, 0.0)
    index = source_index({k: batch[k] for k in ("input_ids", "position_ids") if k in batch}, cp)
    local = shifted.gather(1, index.clamp_min(0))
    return local.masked_fill(index < 0, 0.0)
