"""`shard_batch`: a full batch (identical on every CP rank) -> this rank's local batch for a patched model.

Torch only (the CP core): `ContextParallel.shard_batch` calls it, `longdoc.hf` re-exports it.

    local = cp.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask})
    loss = model(**local).loss        # this rank's share; the sum over the CP group is the mean loss

The local batch holds:
  input_ids (or inputs_embeds)  this rank's tokens, (batch, local_len[, hidden])
  position_ids                  their GLOBAL positions, so RoPE / position embeddings are exact
  labels, shift_labels          targets shifted over the FULL sequence before sharding
                                (shift_labels[t] = labels[t + 1]); -100 where no loss is taken
  num_items_in_batch            the global number of loss tokens (a 0-d tensor, same on every rank)
  longdoc_row_lengths           only where rows are padded: each row's real length (batch,), which a
                                patched model's forward pre-hook takes before the model sees the call
transformers' causal-LM loss sums the local token losses and divides by num_items_in_batch, so each
rank's loss is its share and gradients summed over the group are the single-device gradients.

Any length works: the sequence is padded internally at the end to cp.multiple; padded tokens and
attention_mask == 0 positions never enter the loss. Right padding is exact with no mask at all (causal
attention never lets a real token see a pad after it), so no attention_mask is passed on. Left padding
is turned into right padding: each left-padded row is rolled so that its real tokens come first, every
token keeping its position id (the default 0..seq-1 of the padded row, or the position_ids given), so
leading pads see nothing and count nothing.

Packed rows (transformers.DataCollatorWithFlattening's format: position_ids restarting at 0 at each
document, optionally cu_seq_lens_q/k, max_length_q/k and seq_idx, which must agree with them): every
document keeps its own positions, attends only to itself, and its last token predicts nothing (the loss
equals running each document on its own). Rows of preference pairs packed as [prompt | chosen | rejected]
pass `branches` (longdoc.parallel.batch_branches): each pair is a document, and the local batch carries the pairs
for the patched model's attention. The row is laid out per document (longdoc.parallel.layout.
Packed: each document zigzagged over the ranks, balanced work) and the local batch carries the GLOBAL
document boundaries as cu_seq_lens_q / cu_seq_lens_k (over the flattened, padded batch, as HF counts
them), from which the patched model's attention masks documents. The padding is one extra document.

Content agreement (longdoc.parallel.batch_agree): before returning, the ranks of the CP group check in
one tiny all-gather that they hold the SAME full batch; `ContextParallel(check_agreement=False)` skips it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from longdoc.parallel import batch_branches
from longdoc.parallel.batch_agree import CPInputError, agree_content, checksum
from longdoc.parallel.layout import Packed, round_up

__all__ = ["ROW_LENGTHS", "CPInputError", "checksum", "count_loss_tokens", "documents_of", "shard_batch",
           "shift_labels", "source_index"]

ROW_LENGTHS = "longdoc_row_lengths"  # see _shard; only in local batches with padding
_KNOWN = ("input_ids", "inputs_embeds", "attention_mask", "labels", "position_ids", "cu_seq_lens_q",
          "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "branches")
def _as_tensor(value: Any, name: str) -> torch.Tensor:
    t = value if torch.is_tensor(value) else torch.as_tensor(value)
    if t.dim() == 1 and name != "inputs_embeds":
        t = t.unsqueeze(0)  # one sequence given without a batch dimension
    return t


def _leading_pads(mask: torch.Tensor) -> torch.Tensor:
    """(batch,) number of leading zeros of each row; raises on values other than 0/1 and on holes."""
    m = mask.to(torch.int8)
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold 0/1 (or bool) values")
    lead = (m.cumsum(dim=1) == 0).sum(dim=1)
    real = m.sum(dim=1)
    idx = torch.arange(m.shape[1]).unsqueeze(0)
    contiguous = ((idx >= lead.unsqueeze(1)) & (idx < (lead + real).unsqueeze(1))).to(torch.int8)
    bad = torch.nonzero((contiguous != m).any(dim=1)).flatten()[:4].tolist()
    if bad:
        raise ValueError(f"cp.shard_batch: attention_mask has holes (zeros between real tokens) in rows {bad}; "
                         f"only left and right padding are supported (one contiguous run of real tokens per row). "
                         f"To pack several documents into a row, give position_ids restarting at 0 per document")
    return lead


def _row_documents(pos: torch.Tensor, n_real: int, row: int) -> tuple[int, tuple[int, ...] | None]:
    """(first position, None) for a row numbered consecutively from any start, or (0, document lengths)
    for a packed row (position_ids restarting at 0 at each document); raises otherwise."""
    p = pos[:n_real]
    if n_real == 0 or bool((p == p[0] + torch.arange(n_real, device=p.device)).all()):
        return (int(p[0]) if n_real else 0), None
    try:
        docs = Packed.from_position_ids(p)
    except ValueError:
        raise ValueError(f"cp.shard_batch: position_ids of row {row} are neither consecutive nor packed (restarting "
                         f"at 0 at each document, then going up by 1, as DataCollatorWithFlattening makes them); "
                         f"drop position_ids, shard_batch computes the global positions") from None
    return 0, docs.doc_lens


def _documents_from_cu(cu: torch.Tensor, bsz: int, seq_len: int) -> list[tuple[int, ...]]:
    """Per-row document lengths from cu_seq_lens over the flattened batch (HF's varlen format)."""
    c = [int(x) for x in torch.as_tensor(cu).reshape(-1).tolist()]
    rows = set(range(0, bsz * seq_len + 1, seq_len))
    if not c or c[0] != 0 or c[-1] != bsz * seq_len or any(b <= a for a, b in zip(c, c[1:])) \
            or not rows <= set(c):
        raise ValueError(f"cp.shard_batch: cu_seq_lens_q must be increasing document boundaries from 0 to "
                         f"{bsz * seq_len} (batch x seq, the flattened batch) that include every row boundary, "
                         f"got {c[:8]}{'...' if len(c) > 8 else ''}")
    out = []
    for r in range(bsz):
        cuts = [x - r * seq_len for x in c if r * seq_len <= x <= (r + 1) * seq_len]
        out.append(tuple(b - a for a, b in zip(cuts, cuts[1:])))
    return out


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """Full-sequence targets: out[:, t] = labels[:, t + 1], ignore_index at the end and where the target
    token is padding (attention_mask == 0), so padded tokens never count in the loss."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        out[:, :-1].masked_fill_(attention_mask[:, 1:] == 0, ignore_index)
    return out


def shard_batch(batch: Mapping[str, Any], cp: Any, *, pad_token_id: int = 0, ignore_index: int = -100,
                num_items_in_batch: int | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's part of a full batch (see the module docstring for what it holds).

    Args:
        batch: input_ids (batch, seq) or inputs_embeds (batch, seq, hidden); optional labels (batch, seq)
            in the Hugging Face convention (unshifted, ignore_index where no loss), optional attention_mask
            (batch, seq), right or left padding (left-padded rows are rolled, see the module docstring).
            position_ids: none (computed), the plain 0..seq-1 positions (or a constant offset), or a packed
            row's positions restarting at 0 per document (with optional cu_seq_lens_* agreeing with them).
        cp: the ContextParallel group and layout (typed Any: longdoc.parallel.api imports this module).
        pad_token_id: token used for the internal padding to cp.multiple. Its value never changes the
            result (padded tokens come after every real token and never count); it must be a valid id.
        num_items_in_batch: override the loss-token count, e.g. the total over gradient-accumulation steps
            or data-parallel replicas, so that losses add up to the mean over all of them.
    Raises:
        ValueError for a malformed batch; CPInputError when the CP ranks hold different batches.
    """
    # Only a real group agrees (a stand-in without check_agreement, as in the layout tests, has no peers).
    agree = cp.size > 1 and getattr(cp, "check_agreement", False)
    try:
        fields = _validated(batch, ignore_index, num_items_in_batch)
    except ValueError:
        if agree:  # tell the other ranks, so they raise too instead of waiting for this rank
            agree_content(None, cp, pad_token_id, ignore_index, num_items_in_batch)
        raise
    if agree:
        agree_content(fields, cp, pad_token_id, ignore_index, num_items_in_batch)
    return _shard(fields, cp, pad_token_id, ignore_index, num_items_in_batch)


def _validated(batch: Mapping[str, Any], ignore_index: int, num_items_in_batch) -> dict[str, Any]:
    """The batch's tensors, checked: {"key", "inputs", "labels", "attention_mask", "position_ids"}."""
    unknown = sorted(set(batch) - set(_KNOWN))
    if unknown:
        raise ValueError(f"cp.shard_batch: unknown keys {unknown}; the batch may hold {', '.join(_KNOWN)} "
                         f"(drop other columns before sharding)")
    if ("input_ids" in batch) == ("inputs_embeds" in batch):
        raise ValueError("cp.shard_batch: pass exactly one of input_ids or inputs_embeds")
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    x = _as_tensor(batch[key], key)
    if key == "input_ids" and (x.dim() != 2 or x.is_floating_point()):
        raise ValueError(f"cp.shard_batch: input_ids must be an integer (batch, seq) tensor, got {tuple(x.shape)} "
                         f"{x.dtype}")
    if key == "inputs_embeds" and x.dim() != 3:
        raise ValueError(f"cp.shard_batch: inputs_embeds must be (batch, seq, hidden), got {tuple(x.shape)}")
    bsz, seq_len = x.shape[:2]
    if seq_len == 0:
        raise ValueError("cp.shard_batch: the sequence is empty")
    device = x.device

    def same_shape(name: str) -> torch.Tensor | None:
        if batch.get(name) is None:
            return None
        t = _as_tensor(batch[name], name).to(device)
        if tuple(t.shape) != (bsz, seq_len):
            raise ValueError(f"cp.shard_batch: {name} has shape {tuple(t.shape)}, expected {(bsz, seq_len)} "
                             f"like {key}")
        return t

    mask = same_shape("attention_mask")
    labels = same_shape("labels")
    pos = same_shape("position_ids")
    lead = _leading_pads(mask) if mask is not None else torch.zeros(bsz, dtype=torch.long)
    n_real = mask.sum(dim=1) if mask is not None else torch.full((bsz,), seq_len)
    cu = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k") if batch.get(k) is not None}
    if len(cu) == 2 and not torch.equal(torch.as_tensor(cu["cu_seq_lens_q"]).long(),
                                        torch.as_tensor(cu["cu_seq_lens_k"]).long()):
        raise ValueError("cp.shard_batch: cu_seq_lens_q and cu_seq_lens_k differ; packed self-attention needs the "
                         "same document boundaries for queries and keys")
    cu_docs = _documents_from_cu(torch.as_tensor(next(iter(cu.values()))), bsz, seq_len) if cu else None
    if cu_docs is not None and pos is None:
        pos = torch.cat([torch.cat([torch.arange(n) for n in row]) for row in cu_docs]).view(bsz, seq_len).to(device)
    starts, docs = [0] * bsz, [None] * bsz
    pairs = batch_branches.per_row(batch["branches"], bsz) if batch.get("branches") is not None else None
    if pairs is not None:
        pos = batch_branches.positions(pairs, pos, lead.tolist(), [int(n) for n in n_real], seq_len, device, docs)
    if pos is not None:
        for r in range(bsz):
            if docs[r] is None:
                rolled = torch.roll(pos[r], -int(lead[r]))
                starts[r], docs[r] = _row_documents(rolled, int(n_real[r]), r)
    packed = any(d is not None for d in docs)
    if packed and bool((lead > 0).any()):
        raise ValueError("cp.shard_batch: packed rows (position_ids restarting at 0) with left padding; pad packed "
                         "rows on the right (or not at all: DataCollatorWithFlattening needs no padding)")
    if packed and any(s_ for s_ in starts):
        raise ValueError("cp.shard_batch: a packed batch must number every row's documents from 0 (HF's packed "
                         "format); a row here starts at another position")
    if cu_docs is not None:
        for r in range(bsz):
            mine = docs[r] or (int(n_real[r]),)
            if tuple(cu_docs[r][:len(mine)]) != tuple(mine) or \
                    sum(cu_docs[r][len(mine):]) != seq_len - int(n_real[r]):
                raise ValueError(f"cp.shard_batch: cu_seq_lens_q disagrees with position_ids in row {r} (documents "
                                 f"{list(cu_docs[r])[:6]} vs {list(mine)[:6]}); pass either, or both from one collator")
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None:
        seq_idx = _as_tensor(seq_idx, "seq_idx").to(device)
        for r in range(bsz):
            cuts = torch.nonzero(seq_idx[r, 1:int(n_real[r])] != seq_idx[r, :int(n_real[r]) - 1]).flatten() + 1
            want = [int(x) for x in torch.tensor(docs[r] or (int(n_real[r]),)).cumsum(0)[:-1]]
            if cuts.tolist() != want:
                raise ValueError(f"cp.shard_batch: seq_idx disagrees with the documents of row {r} (position_ids / "
                                 f"cu_seq_lens); pass the collator's fields unchanged")
    if labels is not None and labels.is_floating_point():
        raise ValueError(f"cp.shard_batch: labels must be integer token ids, got {labels.dtype}")
    if labels is not None and num_items_in_batch is not None and int(num_items_in_batch) <= 0:
        raise ValueError(f"cp.shard_batch: num_items_in_batch must be positive, got {int(num_items_in_batch)}")
    return {"key": key, "inputs": x, "labels": labels, "attention_mask": mask, "position_ids": pos, "branches": pairs,
            "rows": _Rows(lead.tolist(), [int(n) for n in n_real], starts, docs if packed else None)}


class _Rows(NamedTuple):
    """How each row is laid out: leading pads (rolled away), real tokens, first position, documents."""

    lead: list[int]
    n_real: list[int]
    start: list[int]  # position id of the first real token (consecutive rows)
    docs: list[tuple[int, ...] | None] | None  # real document lengths per row, when any row is packed


def _roll_left_padding(fields: dict[str, Any]) -> dict[str, Any]:
    """Left-padded rows rolled so their real tokens come first (each token keeps its position id)."""
    rows: _Rows = fields["rows"]
    if not any(rows.lead):
        return fields
    out = dict(fields)
    for name in ("inputs", "labels", "attention_mask", "position_ids"):
        t = fields[name]
        if t is not None:
            out[name] = torch.stack([torch.roll(t[r], -n, dims=0) for r, n in enumerate(rows.lead)])
    if fields["position_ids"] is None:  # the default positions 0..seq-1 of the padded row, kept per token
        out["rows"] = rows._replace(start=rows.lead)
    return out


def _shard(fields: dict[str, Any], cp, pad_token_id: int, ignore_index: int,
           num_items_in_batch) -> dict[str, torch.Tensor]:
    fields = _roll_left_padding(fields)
    key, x, labels, mask = fields["key"], fields["inputs"], fields["labels"], fields["attention_mask"]
    rows: _Rows = fields["rows"]
    bsz, seq_len = x.shape[:2]
    device = x.device
    padded = round_up(seq_len, cp.multiple)
    extra = padded - seq_len
    if extra:
        if key == "input_ids":
            x = torch.cat([x, x.new_full((bsz, extra), pad_token_id)], dim=1)
        else:
            x = torch.cat([x, x.new_zeros((bsz, extra, x.shape[2]))], dim=1)
    targets = None
    if labels is not None:
        targets = shift_labels(labels.long(), mask, ignore_index)
        if extra:
            targets = torch.cat([targets, targets.new_full((bsz, extra), ignore_index)], dim=1)
    if rows.docs is None:
        # consecutive positions from each row's first one; the pads after the real tokens continue them
        start = torch.tensor(rows.start, device=device).unsqueeze(1)
        local: dict[str, torch.Tensor] = {
            key: cp.shard(x, dim=1),
            "position_ids": cp.positions(padded, device=device).unsqueeze(0) + start,
        }
        local_targets = cp.shard(targets, dim=1) if targets is not None else None
        if any(n < padded for n in rows.n_real):
            # Each row's real length: a patched model's forward pre-hook takes it (the model never sees it), for
            # layers whose result depends on the row's length itself (DSA's top-k breaks ties by the row).
            local[ROW_LENGTHS] = torch.tensor(rows.n_real, dtype=torch.long, device=device)
    else:
        packs = [Packed((*(d or (n,)), *((padded - n,) if padded > n else ())))
                 for d, n in zip(rows.docs, rows.n_real)]
        pairs = fields["branches"] or [None] * bsz
        if targets is not None:
            for r, pack in enumerate(packs):  # a document's last token predicts nothing (the next is another's)
                targets[r, [e - 1 for e in pack.starts()[1:]]] = ignore_index
            batch_branches.ignore_between(targets, pairs, ignore_index)
        local = {
            key: torch.cat([cp.shard(x[r:r + 1], dim=1, documents=p) for r, p in enumerate(packs)]),
            "position_ids": torch.stack([cp.shard(batch_branches.position_ids(b, p, device), dim=0, documents=p)
                                         for b, p in zip(pairs, packs)]),
        }
        if fields["branches"] is not None:
            local[batch_branches.BRANCHES] = batch_branches.encode(pairs, device)
        local_targets = (torch.cat([cp.shard(targets[r:r + 1], dim=1, documents=p) for r, p in enumerate(packs)])
                         if targets is not None else None)
        cu = sorted({r * padded + s_ for r, p in enumerate(packs) for s_ in p.starts()})
        local["cu_seq_lens_q"] = local["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32, device=device)
        if any(n < padded for n in rows.n_real):  # the padding document is not a real one (MoE router statistics)
            local[ROW_LENGTHS] = torch.tensor(rows.n_real, dtype=torch.long, device=device)
    if targets is not None:
        if num_items_in_batch is None:
            # max(., 1): a batch with no loss token gives loss 0 (and zero grads) instead of NaN.
            num_items_in_batch = max(int((targets != ignore_index).sum()), 1)
        local["labels"] = local_targets
        local["shift_labels"] = local_targets
        local["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=device)
    return local


class _OneRank:
    """The layout of a single rank (what `count_loss_tokens` shards with): every token stays."""

    size, rank, multiple = 1, 0, 1

    def shard(self, x: torch.Tensor, dim: int = 1, documents=None) -> torch.Tensor:
        return x

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        return torch.arange(seq_len, device=device)


def count_loss_tokens(batch: Mapping[str, Any], ignore_index: int = -100) -> int:
    """The loss tokens cp.shard_batch counts for this full batch (shifted targets that are not ignored,
    not padding, and not across a packed document's end): what to pass as num_items_in_batch when
    summing several micro-batches, e.g. for gradient accumulation."""
    fields = _validated(batch, ignore_index, None)
    if fields["labels"] is None:
        return 0
    return int(_shard(fields, _OneRank(), 0, ignore_index, None)["shift_labels"].ne(ignore_index).sum())


def source_index(batch: Mapping[str, Any], cp) -> torch.Tensor:
    """(batch, local_len): the column of the FULL batch each local token of `shard_batch(batch, cp)` holds,
    -1 for the internal padding (left-padded rows are rolled, packed rows laid out per document)."""
    fields = _validated({k: v for k, v in batch.items() if k != "labels"}, -100, None)
    x = fields["inputs"]
    index = torch.arange(x.shape[1], device=x.device).expand(x.shape[:2])
    if fields["attention_mask"] is not None:  # padding (rolled to the end for left-padded rows) maps nowhere
        index = torch.where(fields["attention_mask"].bool(), index, torch.full_like(index, -1))
    fields = {**fields, "key": "input_ids", "inputs": index}
    return _shard(fields, cp, -1, -100, None)["input_ids"]


def documents_of(cu_seq_lens: torch.Tensor, bsz: int, seq_len: int) -> list[Packed]:
    """Per-row packed documents from the GLOBAL cu_seq_lens of a local batch (what shard_batch makes);
    seq_len is the full (padded) row length."""
    return [Packed(d) for d in _documents_from_cu(cu_seq_lens, bsz, seq_len)]
