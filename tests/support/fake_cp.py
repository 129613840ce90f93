"""A fake CP group (pure layout functions, no processes), so one process can play every rank of a group.

Used by the batch-sharding tests: the per-rank loss shares computed from shards of full-sequence logits
must add up to the single-device mean loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longdoc.parallel import layout


class FakeCP:
    """The layout part of ContextParallel for rank `rank` of `size`, without a process group."""

    def __init__(self, rank: int, size: int, layout_name: str = "zigzag"):
        self.rank, self.size, self.layout = rank, size, layout_name

    @property
    def multiple(self) -> int:
        return layout.num_chunks(self.layout, self.size)

    def shard(self, x, dim=1, documents=None):
        if documents is not None:
            return documents.shard(x, dim, self.rank, self.size, self.layout)
        return layout.shard(x, dim, self.rank, self.size, self.layout)

    def positions(self, seq_len, device=None):
        return layout.positions(seq_len, self.rank, self.size, self.layout, device=device)


def loss_share(logits_full: torch.Tensor, local: dict, cp: FakeCP) -> torch.Tensor:
    """What the patched model's loss computes on one rank, from the full logits."""
    padded = local["input_ids"].shape[1] * cp.size
    full = torch.zeros(logits_full.shape[0], padded, logits_full.shape[2])
    full[:, : logits_full.shape[1]] = logits_full
    local_logits = cp.shard(full, dim=1)
    loss = F.cross_entropy(local_logits.reshape(-1, full.shape[-1]), local["shift_labels"].reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss / local["num_items_in_batch"]
