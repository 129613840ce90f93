"""The shared-prefix preference row (longdoc.corpus.preference) as a model sees it: which token predicts which,
who attends to whom, and the per-pair log-probability sums a DPO loss needs - the pure-torch reference.

    from longdoc.corpus.preference_logps import branch_targets, pair_logps, shifted_targets, sibling_mask
    mask = sibling_mask(row)                                    # (T, T) bool, True = may attend
    logits = model(input_ids, position_ids=row positions, attention_mask=<mask as 4D>).logits[0]
    chosen, rejected = pair_logps(logits, row)                  # (pairs,) each

A row is one sequence [prompt | chosen | rejected] per pair (its `branches` give [prompt_start, chosen_start,
rejected_start, end]); its labels are unshifted. The usual shift pairs logit t-1 with label t; at rejected_start
that would be chosen's last token, so `branch_targets` names the predicting position of every labelled token
explicitly: t - 1, except rejected_start, predicted by the prompt's last token (chosen_start - 1), which so
predicts two tokens (`shifted_targets`: the same, as per-position targets plus one extra per pair).
`two_sequence_rows` gives the same pairs as TRL lays them out (prompt+chosen and prompt+rejected, separate rows),
where the usual shift is right: the reference `pair_logps` is checked against.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

IGNORE = -100


class Targets(NamedTuple):
    """Every labelled token of a row, as (predicting position, predicted position, pair, side); each (n,) int64."""

    logit_index: torch.Tensor  # the position whose logit predicts the token
    target_index: torch.Tensor  # the token's own position (its id is input_ids[target_index])
    pair: torch.Tensor  # which pair of the row (index into branches)
    rejected: torch.Tensor  # bool: the token is rejected's (else chosen's)


def _branches(row: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    out = []
    for b in row["branches"]:
        p, c, r, e = (int(x) for x in b)
        if not p < c < r < e:
            raise ValueError(f"a branch must be [prompt_start, chosen_start, rejected_start, end] with each part "
                             f"non-empty, got {[p, c, r, e]}")
        out.append((p, c, r, e))
    return out


def branch_targets(row: dict[str, Any]) -> Targets:
    """For each chosen and rejected token of `row`, the position whose logit predicts it (see the module doc)."""
    logit, target, pair, side = [], [], [], []
    for k, (_, c, r, e) in enumerate(_branches(row)):
        chosen, rejected = torch.arange(c, r), torch.arange(r, e)
        # chosen: the usual shift; rejected: its first token hangs off the prompt's last token, not chosen's last
        logit += [chosen - 1, torch.cat([torch.tensor([c - 1]), rejected[:-1]])]
        target += [chosen, rejected]
        pair.append(torch.full((e - c,), k))
        side += [torch.zeros(r - c, dtype=torch.bool), torch.ones(e - r, dtype=torch.bool)]
    if not logit:
        empty = torch.zeros(0, dtype=torch.long)
        return Targets(empty, empty, empty, empty.bool())
    return Targets(torch.cat(logit), torch.cat(target), torch.cat(pair), torch.cat(side))


def shifted_targets(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same targets laid out per predicting position, the form a CP loss shards (labels are shifted before
    sharding): `next_ids` (T,), the token position t's logit predicts under the usual shift, IGNORE where it
    predicts nothing (the prompt but its last token, chosen's last token - never rejected's first -, rejected's
    last); and `extra` (pairs, 2) of [logit_index, token_id]: the one prediction per pair the usual shift cannot
    hold, rejected's first token from the prompt's last position (which so has two targets)."""
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
    next_ids = torch.full_like(ids, IGNORE)
    t = branch_targets(row)
    first_rejected = torch.tensor([r for _, _, r, _ in _branches(row)], dtype=torch.long)
    usual = ~torch.isin(t.target_index, first_rejected)
    next_ids[t.logit_index[usual]] = ids[t.target_index[usual]]
    # in pair order, as branch_targets lists them: [the prompt's last position, rejected's first token id]
    extra = torch.stack([t.logit_index[~usual], ids[t.target_index[~usual]]], dim=1)
    return next_ids, extra.reshape(-1, 2)


def sibling_mask(row: dict[str, Any]) -> torch.Tensor:
    """(T, T) bool, True where query token i may attend key token j: within a pair, prompt and chosen causally,
    rejected to the prompt and to itself causally (never chosen); nothing across pairs."""
    n = len(row["input_ids"])
    mask = torch.zeros(n, n, dtype=torch.bool)
    for p, c, r, e in _branches(row):
        mask[p:r, p:r] = torch.ones(r - p, r - p, dtype=torch.bool).tril()  # prompt + chosen: causal
        mask[r:e, p:c] = True  # rejected sees the whole prompt
        mask[r:e, r:e] = torch.ones(e - r, e - r, dtype=torch.bool).tril()
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool (T, T) mask as the (1, 1, T, T) additive float mask transformers' eager attention adds to its
    scores (0 where allowed, the dtype's minimum elsewhere); passed as attention_mask it is used as is."""
    out = torch.zeros(mask.shape, dtype=dtype)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]


def two_sequence_rows(row: dict[str, Any]) -> list[dict[str, list[int]]]:
    """Each pair of `row` as TRL lays it out: [prompt+chosen, prompt+rejected, ...] (two rows per pair, in pair
    order), each with unshifted labels (-100 on the prompt) and positions from 0: here the usual shift is right."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    out = []
    for p, c, r, e in _branches(row):
        for a, b in ((c, r), (r, e)):
            seq = ids[p:c] + ids[a:b]
            out.append({"input_ids": seq, "labels": [IGNORE] * (c - p) + labels[a:b],
                        "position_ids": list(range(len(seq)))})
    return out


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    # log-softmax in at least float32: bf16 logits lose the small differences a DPO margin is made of
    return torch.log_softmax(logits if logits.dtype in (torch.float32, torch.float64) else logits.float(), dim=-1)


def pair_logps(logits: torch.Tensor, row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities per pair, each (pairs,), from the (T, vocab) logits of a
    shared-prefix row run with `sibling_mask` and the row's position_ids."""
    ids = torch.as_tensor(row["input_ids"], device=logits.device)
    t = branch_targets(row)
    dev = logits.device
    # only the rows of the logits that predict something: (n, vocab), never (T, vocab) in float32 at once
    logp = _log_probs(logits[t.logit_index.to(dev)]).gather(-1, ids[t.target_index.to(dev)][:, None])[:, 0]
    n = len(row["branches"])
    sums = torch.zeros(2, n, dtype=logp.dtype, device=dev)
    sums.index_put_((t.rejected.long().to(dev), t.pair.to(dev)), logp, accumulate=True)
    return sums[0], sums[1]


def sequence_logp(logits: torch.Tensor, labels: list[int] | torch.Tensor) -> torch.Tensor:
    """The summed log-probability of the labelled tokens of one ordinary row (the usual shift: logit t-1 predicts
    label t); the two-sequence reference."""
    labels = torch.as_tensor(labels, device=logits.device)
    keep = labels[1:] != IGNORE
    logp = _log_probs(logits[:-1][keep]).gather(-1, labels[1:][keep][:, None])[:, 0]
    return logp.sum()
