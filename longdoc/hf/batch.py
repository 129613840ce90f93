"""`shard_batch`: a full batch (identical on every CP rank) -> this rank's local batch for a patched model.

    local = cp.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask})
    loss = model(**local).loss        # this rank's share; the sum over the CP group is the mean loss

The local batch holds:
  input_ids (or inputs_embeds)  this rank's tokens, (batch, local_len[, hidden])
  position_ids                  their GLOBAL positions, so RoPE / position embeddings are exact
  labels, shift_labels          targets shifted over the FULL sequence before sharding
                                (shift_labels[t] = labels[t + 1]); -100 where no loss is taken
  num_items_in_batch            the global number of loss tokens (a 0-d tensor, same on every rank)
transformers' causal-LM loss sums the local token losses and divides by num_items_in_batch, so each
rank's loss is its share and gradients summed over the group are the single-device gradients.

Any length works: the sequence is padded internally at the end to cp.multiple; padded tokens and
attention_mask == 0 positions never enter the loss. Right padding is exact with no mask at all (causal
attention never lets a real token see a pad after it), so no attention_mask is passed on. Left padding
is refused: it needs a padding mask inside the ring, which the CP kernels do not compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longdoc.parallel.layout import round_up

_KNOWN = ("input_ids", "inputs_embeds", "attention_mask", "labels", "position_ids")


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    t = value if torch.is_tensor(value) else torch.as_tensor(value)
    if t.dim() == 1 and name != "inputs_embeds":
        t = t.unsqueeze(0)  # one sequence given without a batch dimension
    return t


def _check_padding(mask: torch.Tensor) -> None:
    m = mask.to(torch.int8)
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold 0/1 (or bool) values")
    if m.shape[1] < 2 or bool((m[:, 1:] <= m[:, :-1]).all()):
        return
    rows = [int(r) for r in torch.nonzero((m[:, 1:] > m[:, :-1]).any(dim=1)).flatten()[:4]]
    left = all(int(m[r, 0]) == 0 for r in rows)
    what = "left padding" if left else "holes (zeros between real tokens)"
    raise ValueError(
        f"cp.shard_batch: attention_mask has {what} in rows {rows}; only right padding is supported under CP "
        f"(it is exact without a mask, left padding would need a padding mask inside the ring attention). "
        f"Tokenize with tokenizer.padding_side = 'right'; to pack several documents, concatenate them into "
        f"one row instead"
    )


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """Full-sequence targets: out[:, t] = labels[:, t + 1], ignore_index at the end and where the target
    token is padding (attention_mask == 0), so padded tokens never count in the loss."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        out[:, :-1].masked_fill_(attention_mask[:, 1:] == 0, ignore_index)
    return out


def shard_batch(batch: Mapping[str, Any], cp, *, pad_token_id: int = 0, ignore_index: int = -100,
                num_items_in_batch: int | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """This rank's part of a full batch (see the module docstring for what it holds).

    Args:
        batch: input_ids (batch, seq) or inputs_embeds (batch, seq, hidden); optional labels (batch, seq)
            in the Hugging Face convention (unshifted, ignore_index where no loss), optional attention_mask
            (batch, seq), right padding only. position_ids are computed; passing them is refused unless
            they are the plain 0..seq-1 positions.
        cp: the ContextParallel group and layout.
        pad_token_id: token used for the internal padding to cp.multiple. Its value never changes the
            result (padded tokens come after every real token and never count); it must be a valid id.
        num_items_in_batch: override the loss-token count, e.g. the total over gradient-accumulation steps
            or data-parallel replicas, so that losses add up to the mean over all of them.
    """
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
    if pos is not None and not bool((pos == torch.arange(seq_len, device=device)).all()):
        raise ValueError("cp.shard_batch: position_ids other than 0..seq-1 (packed sequences, offsets) are not "
                         "supported under CP; drop position_ids, shard_batch computes the global positions")
    if mask is not None:
        _check_padding(mask)

    padded = round_up(seq_len, cp.multiple)
    extra = padded - seq_len
    if extra:
        if key == "input_ids":
            x = torch.cat([x, x.new_full((bsz, extra), pad_token_id)], dim=1)
        else:
            x = torch.cat([x, x.new_zeros((bsz, extra, x.shape[2]))], dim=1)
    local: dict[str, torch.Tensor] = {
        key: cp.shard(x, dim=1),
        "position_ids": cp.positions(padded, device=device).unsqueeze(0).repeat(bsz, 1),
    }
    if labels is not None:
        if labels.is_floating_point():
            raise ValueError(f"cp.shard_batch: labels must be integer token ids, got {labels.dtype}")
        targets = shift_labels(labels.long(), mask, ignore_index)
        if extra:
            targets = torch.cat([targets, targets.new_full((bsz, extra), ignore_index)], dim=1)
        if num_items_in_batch is None:
            # max(., 1): a batch with no loss token gives loss 0 (and zero grads) instead of NaN.
            num_items_in_batch = max(int((targets != ignore_index).sum()), 1)
        elif int(num_items_in_batch) <= 0:
            raise ValueError(f"cp.shard_batch: num_items_in_batch must be positive, got {int(num_items_in_batch)}")
        local_targets = cp.shard(targets, dim=1)
        local["labels"] = local_targets
        local["shift_labels"] = local_targets
        local["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=device)
    return local
