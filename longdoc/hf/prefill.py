"""Prefill for evaluation: a patched model's forward over a whole long prompt under CP, no KV cache.

    local = prefill(model, cp, batch)                          # (batch, local_len, vocab), this rank's tokens
    at = prefill(model, cp, batch, positions=[n - 1])          # (batch, 1, vocab) on every rank
    lp = span_logprobs(model, cp, batch, start, end)           # (batch, end - start): log p(answer tokens)
    lp, greedy = target_scores(model, cp, batch, positions, targets)  # and whether each target is the argmax

Chosen positions never need the whole (length x vocab) tensor anywhere: each rank runs the LM head
only on the requested positions it holds (transformers' `logits_to_keep`), and one all-reduce of
(batch, n, vocab) logits (or (batch, n) log-probs) brings the answer to every rank. Results of the
position helpers are detached (evaluation, not training: use labels with -100 for span losses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from longdoc.hf.modelinfo import hf_model
from longdoc.parallel import comm
from longdoc.parallel.api import ContextParallel
from longdoc.parallel.batch import shard_batch, source_index

__all__ = ["prefill", "gather_positions", "target_logprobs", "target_scores", "span_logprobs", "label_losses"]


def _check_patched(model: torch.nn.Module, cp: ContextParallel) -> None:
    handle = getattr(hf_model(model), "_longdoc_cp", None)
    if handle is None:
        raise ValueError("prefill needs a model patched for CP: call longdoc.patch(model, cp) first")
    if handle.cp is not cp:
        raise ValueError(f"the model is patched with {handle.cp!r}, not with the {cp!r} passed here; "
                         f"pass the same ContextParallel object")


def _all_reduce(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    if cp.size > 1:
        comm.all_reduce(t, cp.group, cp.timeout, cp.guard, "all_reduce prefill")
    return t


def _local_index(cp: ContextParallel, padded_len: int, positions: torch.Tensor) -> torch.Tensor:
    """For global positions, their index in this rank's local tokens, or -1 where another rank holds them."""
    where = torch.full((padded_len,), -1, dtype=torch.long, device=positions.device)
    mine = cp.positions(padded_len, device=positions.device)
    where[mine] = torch.arange(mine.numel(), device=positions.device)
    return where[positions]


def _batch_local_index(cp: ContextParallel, batch: Mapping[str, Any], positions: torch.Tensor) -> torch.Tensor:
    """Like _local_index, per row, for the layout cp.shard_batch gives this batch (left-padded rows are
    rolled, packed rows laid out per document): (batch, n) local indices, -1 where another rank holds them."""
    src = source_index(batch, cp).to(positions.device)  # (batch, local_len) full-batch column of each token
    bsz, local_len = src.shape
    where = torch.full((bsz, int(positions.max()) + 1 if positions.numel() else 1), -1, dtype=torch.long,
                       device=positions.device)
    rows, cols = torch.nonzero((src >= 0) & (src < where.shape[1]), as_tuple=True)
    where[rows, src[rows, cols]] = cols
    return where.gather(1, positions)


def _positions(positions: Any, bsz: int, seq_len: int, device: torch.device) -> torch.Tensor:
    p = torch.as_tensor(positions, dtype=torch.long, device=device)
    if p.dim() == 0:
        p = p.reshape(1)
    if p.dim() == 1:
        p = p.unsqueeze(0).expand(bsz, -1)
    if p.dim() != 2 or p.shape[0] != bsz:
        raise ValueError(f"positions must be (n,) or (batch={bsz}, n), got shape {tuple(p.shape)}")
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= seq_len):
        raise ValueError(f"positions must lie in [0, {seq_len}) (the sequence length), got "
                         f"[{int(p.min())}, {int(p.max())}]")
    return p


def _local_batch(model, cp: ContextParallel, batch: Mapping[str, Any], pad_token_id: int) -> dict:
    _check_patched(model, cp)
    return shard_batch({k: v for k, v in batch.items() if k != "labels"}, cp, pad_token_id=pad_token_id)


def _run(model, cp: ContextParallel, batch: Mapping[str, Any], keep: torch.Tensor | None, pad_token_id: int,
         local: dict | None = None):
    local = _local_batch(model, cp, batch, pad_token_id) if local is None else local
    extra = {} if keep is None else {"logits_to_keep": keep}
    with torch.no_grad():
        logits = model(**local, use_cache=False, **extra).logits
    return local, logits


def _owned_logits(model, cp: ContextParallel, batch: Mapping[str, Any], positions, pad_token_id: int):
    """Logits at the requested positions this rank holds: (positions (b, n), slot (b, n), logits (b, k, V)),
    where logits[:, slot[i, j]] belongs to positions[i, j] when slot[i, j] >= 0."""
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    x = torch.as_tensor(batch[key])
    if key == "input_ids" and x.dim() == 1:
        x = x.unsqueeze(0)
    bsz, seq_len = x.shape[:2]
    p = _positions(positions, bsz, seq_len, x.device)
    local = _local_batch(model, cp, batch, pad_token_id)  # first: every rank checks the batch, or all raise
    local_idx = _batch_local_index(cp, batch, p)  # (b, n), -1 where another rank holds the token
    keep = torch.unique(local_idx[local_idx >= 0])  # sorted local indices the LM head must see
    _, logits = _run(model, cp, batch, keep, pad_token_id, local)
    if logits.shape[1] != keep.numel():
        logits = logits[:, keep]  # a model without logits_to_keep support returned all local logits
    slot = torch.searchsorted(keep, local_idx.clamp(min=0))
    slot = torch.where(local_idx >= 0, slot, torch.full_like(slot, -1))
    return p, slot, logits


def prefill(model: torch.nn.Module, cp: ContextParallel, batch: Mapping[str, Any], *,
            positions: Sequence[int] | torch.Tensor | None = None, pad_token_id: int = 0) -> torch.Tensor:
    """Forward the full batch (identical on every rank) under CP without a KV cache.

    Without `positions`: this rank's local logits (batch, local_len, vocab), for the tokens at global
    positions cp.positions(padded_len) (the sequence is padded to cp.multiple; ignore padded rows).
    With `positions` ((n,) or (batch, n) global positions): (batch, n, vocab) logits at those positions,
    identical on every rank, computed without building the full logits anywhere.
    """
    if positions is None:
        return _run(model, cp, batch, None, pad_token_id)[1]
    p, slot, logits = _owned_logits(model, cp, batch, positions, pad_token_id)
    out = logits.new_zeros((*p.shape, logits.shape[-1]))
    rows, cols = torch.nonzero(slot >= 0, as_tuple=True)
    out[rows, cols] = logits[rows, slot[rows, cols]]
    return _all_reduce(out, cp)


def label_losses(model: torch.nn.Module, cp: ContextParallel, batch: Mapping[str, Any], *,
                 chunk_tokens: int | None = None, pad_token_id: int = 0) -> tuple[torch.Tensor, dict]:
    """(-log p of each labelled token this rank holds, fp32 (n,), in the order of local["shift_labels"]'s entries
    other than -100; the local batch). From the decoder's hidden states through the LM head `chunk_tokens` tokens at
    a time (default: sized from the vocabulary, longdoc.runtime.budgets), so no (local tokens x vocab) logits exist; the
    model's own logits of a few positions check the head first (an unknown final transform is refused by name)."""
    from longdoc.hf.head import LogitHead, token_ce
    from longdoc.hf.patch import PROBE_ROWS, check_probe
    from longdoc.runtime.budgets import loss_chunk_tokens

    _check_patched(model, cp)
    local = shard_batch(dict(batch), cp, pad_token_id=pad_token_id)
    labels = local.pop("shift_labels")
    local.pop("labels", None)
    local.pop("num_items_in_batch", None)
    hf = hf_model(model)
    held: dict = {}

    def grab(module, args, output):
        held["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    rows = min(PROBE_ROWS, local["input_ids"].shape[1])
    hook = hf.get_decoder().register_forward_hook(grab)
    try:
        with torch.no_grad():
            probe = model(**local, use_cache=False,
                          logits_to_keep=torch.arange(rows, device=local["input_ids"].device)).logits
    finally:
        hook.remove()
    head = LogitHead(hf)
    check_probe(hf._longdoc_cp.model_name, probe[:, :rows], head, held["h"][:, :rows])
    chunk = chunk_tokens or loss_chunk_tokens(hf.get_output_embeddings().weight.shape[0])
    return token_ce(head, held["h"], labels, chunk), {**local, "shift_labels": labels}


def target_logprobs(model: torch.nn.Module, cp: ContextParallel, batch: Mapping[str, Any],
                    positions: Sequence[int] | torch.Tensor, targets: torch.Tensor, *,
                    pad_token_id: int = 0) -> torch.Tensor:
    """log p(targets[i, j] | tokens up to positions[i, j]) as a (batch, n) fp32 tensor on every rank.

    Only (batch, n) numbers travel: each rank takes the log-softmax of the rows it holds."""
    return target_scores(model, cp, batch, positions, targets, pad_token_id=pad_token_id)[0]


def target_scores(model: torch.nn.Module, cp: ContextParallel, batch: Mapping[str, Any],
                  positions: Sequence[int] | torch.Tensor, targets: torch.Tensor, *,
                  pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, is-argmax) of targets[i, j] after the tokens up to positions[i, j]: (batch, n) fp32
    and bool tensors on every rank (lm-eval's loglikelihood and its is_greedy). Each rank scores the rows it
    holds; one all-reduce of (batch, n, 2) numbers."""
    p, slot, logits = _owned_logits(model, cp, batch, positions, pad_token_id)
    targets = torch.as_tensor(targets, device=logits.device).long()
    if targets.dim() == 1:
        targets = targets.unsqueeze(0).expand(p.shape[0], -1)
    if targets.shape != p.shape:
        raise ValueError(f"targets must match positions {tuple(p.shape)}, got {tuple(targets.shape)}")
    out = torch.zeros((*p.shape, 2), dtype=torch.float32, device=logits.device)  # (log p, 1 where argmax)
    rows, cols = torch.nonzero(slot >= 0, as_tuple=True)
    if rows.numel():
        rows_logits = logits[rows, slot[rows, cols]].float()  # (k, vocab)
        picked = targets[rows, cols]
        out[rows, cols, 0] = torch.log_softmax(rows_logits, dim=-1).gather(1, picked.unsqueeze(1)).squeeze(1)
        out[rows, cols, 1] = (rows_logits.argmax(dim=-1) == picked).float()
    out = _all_reduce(out, cp)
    return out[..., 0], out[..., 1] > 0.5


def span_logprobs(model: torch.nn.Module, cp: ContextParallel, batch: Mapping[str, Any], start: int, end: int,
                  *, pad_token_id: int = 0) -> torch.Tensor:
    """Per-token log-probabilities (batch, end - start) of input_ids[:, start:end] given everything before,
    e.g. an answer span after a long document; `.sum(-1)` is the span's log-likelihood."""
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if not 1 <= start < end <= ids.shape[1]:
        raise ValueError(f"need 1 <= start < end <= {ids.shape[1]} (the first token has no prediction), "
                         f"got start={start}, end={end}")
    positions = torch.arange(start - 1, end - 1, device=ids.device)
    return target_logprobs(model, cp, batch, positions, ids[:, start:end], pad_token_id=pad_token_id)


def gather_positions(local: torch.Tensor, cp: ContextParallel, positions: Sequence[int] | torch.Tensor,
                     *, dim: int = 1) -> torch.Tensor:
    """Values of a sharded tensor (e.g. local logits from `prefill`) at chosen global positions, on every
    rank: `local` holds this rank's part along `dim`; returns the entries at `positions` (n,) along `dim`.
    For plain rows (cp's layout); for packed or left-padded batches use prefill(..., positions=).
    One all-reduce of the selected entries; the full tensor is never gathered."""
    dim = dim % local.dim()
    padded = local.shape[dim] * cp.size
    p = torch.as_tensor(positions, dtype=torch.long, device=local.device).reshape(-1)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= padded):
        raise ValueError(f"positions must lie in [0, {padded}), got [{int(p.min())}, {int(p.max())}]")
    idx = _local_index(cp, padded, p)
    picked = local.detach().index_select(dim, idx.clamp(min=0))
    shape = [1] * local.dim()
    shape[dim] = -1
    picked = torch.where((idx >= 0).reshape(shape), picked, torch.zeros((), dtype=local.dtype, device=local.device))
    return _all_reduce(picked.contiguous(), cp)
