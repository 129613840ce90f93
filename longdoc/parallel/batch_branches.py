"""Preference pairs (sibling branches, `layout.Branches`) in a batch for `cp.shard_batch`.

A full batch may carry `branches`: one `Branches` for every row, or one entry per row (a `Branches`, its spans, or
None for a row without pairs). Such a row is a packed row whose documents are its pairs and the stretches between
them (`Branches.documents`); its position ids restart at 0 at every document, rejected's continuing from the end of
its prompt (`Branches.position_ids`: given position_ids must be exactly these, or are computed). The last token of
chosen predicts nothing (the next token is rejected's first). The local batch carries the pairs as one tensor,
`BRANCHES` (batch, pairs, 4) of global row indices (-1 rows where a row has fewer pairs), which a patched model's
forward pre-hook takes before the model sees the call (longdoc.hf.call_checks).
"""

from __future__ import annotations

from typing import Any

import torch

from longdoc.parallel.layout import Branches, Packed

BRANCHES = "longdoc_branches"  # the local batch's pairs (see the module docstring)


def per_row(value: Any, bsz: int) -> list[Branches | None]:
    """`batch["branches"]` as one Branches or None per row; raises ValueError naming the expected forms."""
    if isinstance(value, Branches):
        return [value] * bsz
    rows = list(value) if isinstance(value, (list, tuple)) else None
    if rows is None or len(rows) != bsz:
        raise ValueError(f"cp.shard_batch: branches must be one longdoc Branches for every row, or a list with one "
                         f"entry per row ({bsz}): a Branches, its (prompt_start, chosen_start, rejected_start, end) "
                         f"spans, or None; got {type(value).__name__}"
                         + (f" of {len(rows)} entries" if rows is not None else ""))
    return [r if r is None or isinstance(r, Branches) else Branches(r) for r in rows]


def row_positions(pairs: Branches, pos: torch.Tensor | None, lead: int, n_real: int, row: int) -> torch.Tensor:
    """The position ids of one row's real tokens under its pairs, checked against `pos` (the row's given ones)."""
    if lead:
        raise ValueError(f"cp.shard_batch: row {row} has branches and left padding; pad rows with pairs on the right")
    if pairs.end > n_real:
        raise ValueError(f"cp.shard_batch: the last pair of row {row} ends at {pairs.end}, past its {n_real} real "
                         f"tokens")
    want = pairs.position_ids(n_real, pos.device if pos is not None else None)
    if pos is not None and not torch.equal(pos[:n_real].long(), want):
        raise ValueError(f"cp.shard_batch: position_ids of row {row} are not those of its branches (0.. per "
                         f"document, rejected continuing from its prompt's end: Branches.position_ids); drop "
                         f"position_ids, shard_batch computes them")
    return want


def positions(rows: list[Branches | None], pos: torch.Tensor | None, lead: list[int], n_real: list[int],
              seq_len: int, device, docs: list) -> torch.Tensor:
    """The batch's position ids with every row of pairs numbered by them (checked against the given `pos`);
    fills `docs[r]` with the document lengths of each such row, in place."""
    out = torch.arange(seq_len, device=device).repeat(len(rows), 1) if pos is None else pos.clone()
    for r, row in enumerate(rows):
        if row is not None:
            out[r, :n_real[r]] = row_positions(row, None if pos is None else pos[r], lead[r], n_real[r], r)
            docs[r] = row.documents(n_real[r]).doc_lens
    return out


def encode(rows: list[Branches | None], device: torch.device | str | None = None) -> torch.Tensor:
    """(batch, most pairs in a row, 4) long tensor of every row's spans, -1 rows for missing pairs."""
    out = torch.full((len(rows), max(len(r.spans) if r else 0 for r in rows), 4), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, :len(r.spans)] = torch.tensor(r.spans)
    return out.to(device)


def decode(t: torch.Tensor) -> tuple[Branches | None, ...]:
    """Inverse of `encode`; raises ValueError for a tensor it did not make."""
    if not torch.is_tensor(t) or t.dim() != 3 or t.shape[-1] != 4 or t.is_floating_point():
        raise ValueError(f"{BRANCHES} must be a (batch, pairs, 4) integer tensor")
    rows = []
    for row in t.tolist():
        spans = [s for s in row if s != [-1] * 4]
        rows.append(Branches(tuple(tuple(s) for s in spans)) if spans else None)
    return tuple(rows)


def ignore_between(targets: torch.Tensor, rows: list[Branches | None], ignore_index: int) -> None:
    """In place: the shifted target of chosen's last token (rejected's first token) is not a prediction."""
    for i, r in enumerate(rows):
        for _, _, rejected, _ in r.spans if r is not None else ():
            targets[i, rejected - 1] = ignore_index


def position_ids(pairs: Branches | None, pack: Packed, device) -> torch.Tensor:
    """A padded row's position ids: its documents', rejected's continuing from its prompt."""
    return pack.position_ids(device) if pairs is None else pairs.position_ids(pack.seq_len, device, documents=pack)
