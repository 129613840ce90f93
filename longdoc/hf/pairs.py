"""Preference pairs (sibling branches, longdoc.parallel.layout.Branches) of a packed training batch on their way to
attention: the forward pre-hook takes cp.shard_batch's `longdoc_branches`, `read` checks them against the call's
documents, and `keep` stores them on the handle AND on the call's cu_seq_lens_q tensor, so that an
activation-checkpointing recompute after another forward attends with its own batch's pairs (as
attention.call_documents reads its documents from that tensor)."""

from __future__ import annotations

from typing import Any

import torch

from longdoc.parallel.batch_branches import BRANCHES, decode
from longdoc.parallel.layout import Branches, Packed

ATTR = "_longdoc_branches"


def read(value: Any, docs: list[Packed]) -> tuple[Branches | None, ...] | None:
    """Per row Branches or None (None overall when no row has pairs); ValueError when they do not fit the call."""
    if value is None:
        return None
    rows = decode(value)
    if len(rows) != len(docs):
        raise ValueError(f"{BRANCHES} has {len(rows)} rows for a batch of {len(docs)}")
    for row, d in zip(rows, docs):
        if row is not None:
            row.check(d)
    return rows if any(r is not None for r in rows) else None


def keep(handle: Any, cu: torch.Tensor | None, rows: tuple[Branches | None, ...] | None) -> None:
    handle.branches = rows
    if torch.is_tensor(cu):
        setattr(cu, ATTR, rows)


def of_call(handle: Any, cu: torch.Tensor | None) -> tuple[Branches | None, ...] | None:
    """This call's pairs per row: kept with its own cu_seq_lens_q when the model passes that down, else the
    forward's."""
    if cu is None or cu is handle.documents_from:
        return handle.branches
    return getattr(cu, ATTR, None)
