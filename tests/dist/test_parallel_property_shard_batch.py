"""Property test: `cp.shard_batch` + a patched tiny model == one process, over seeded random batches.

Each case draws (torch generator seeded by world size and case number) a batch size, a length, right
padding per row, a random label mask and a split into micro-batches whose loss shares are scaled by
`num_items_in_batch` = the loss tokens of ALL micro-batches (gradient accumulation). Summed over the
micro-batches and the CP group, loss and grads must equal the single-process mean loss and its grads.
One spawn per world size (cp 1..4); the loop runs inside and returns every mismatch at once.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
DEFAULT_CASES = {1: 16, 2: 16, 3: 10, 4: 10}  # 52 in the default suite (the larger worlds cost more)
SLOW_CASES = {1: 110, 2: 140, 3: 120, 4: 140}  # 510 in the slow tier


def draw(world: int, case: int) -> tuple[dict, list[list[int]]]:
    """(full batch, micro-batch row groups) for one case; identical on every rank."""
    g = torch.Generator().manual_seed(1000 * world + case)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    bsz, length = r(1, 3), r(2, 56)
    ids = torch.randint(0, 256, (bsz, length), generator=g)
    mask = torch.ones(bsz, length, dtype=torch.long)
    labels = ids.clone()
    for row in range(bsz):
        if r(0, 1):  # right padding
            mask[row, r(2, length):] = 0
        drop = torch.rand(length, generator=g) < torch.rand((), generator=g) * 0.6
        labels[row, drop] = -100
        keep = r(1, int(mask[row].sum()) - 1)  # at least one loss token per row, inside its real tokens
        labels[row, keep] = ids[row, keep]
    batch = {"input_ids": ids, "labels": labels}
    if r(0, 1) or not bool(mask.all()):
        batch["attention_mask"] = mask
    order = torch.randperm(bsz, generator=g).tolist()
    cuts = sorted(set(torch.randint(1, bsz + 1, (r(0, bsz - 1),), generator=g).tolist()) | {bsz}) if bsz > 1 else [1]
    groups, start = [], 0
    for c in cuts:
        groups.append(order[start:c])
        start = c
    return batch, [grp for grp in groups if grp]


def _rows(batch: dict, rows: list[int]) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _loss_targets(batch: dict) -> torch.Tensor:
    """HF convention: labels shifted by one inside the loss; pads never count."""
    labels = batch["labels"].clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    return labels[:, 1:]


def _reference(model, batch: dict, groups: list[list[int]]) -> tuple[float, dict]:
    total = int((_loss_targets(batch) != -100).sum())
    model.zero_grad()
    loss_sum = 0.0
    for rows in groups:
        mb = _rows(batch, rows)
        logits = model(input_ids=mb["input_ids"], attention_mask=mb.get("attention_mask")).logits[:, :-1]
        targets = _loss_targets(mb)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                 targets.reshape(-1), ignore_index=-100, reduction="sum") / total
        loss.backward()
        loss_sum += float(loss.detach())
    return loss_sum, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cp_step(model, cp, batch: dict, groups: list[list[int]]) -> tuple[float, dict]:
    import torch.distributed as dist

    total = int((_loss_targets(batch) != -100).sum())
    model.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for rows in groups:
        out = model(**cp.shard_batch(_rows(batch, rows), num_items_in_batch=total))
        out.loss.backward()
        loss_sum += out.loss.detach().double()
    if cp.size > 1:
        dist.all_reduce(loss_sum, group=cp.group)
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            if cp.size > 1:
                dist.all_reduce(g, group=cp.group)
            grads[n] = g
    return float(loss_sum), grads


def property_cases(rank: int, world_size: int, cases: int) -> list[str]:
    import copy

    import longdoc
    from longdoc import models

    torch.manual_seed(0)
    ref_model = models.tiny_model("llama", seed=0).float()
    model = copy.deepcopy(ref_model)
    cp = longdoc.ContextParallel()
    longdoc.patch(model, cp)
    mismatches = []
    for case in range(cases):
        batch, groups = draw(world_size, case)
        ref_loss, ref_grads = _reference(ref_model, batch, groups)
        loss, grads = _cp_step(model, cp, batch, groups)
        # Relative to each tensor's scale, floored at 1e-3 of the largest: with a few real tokens some grads
        # are zero in exact arithmetic (1e-16 in float64) and only fp32 rounding (1e-7) is left to compare.
        floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
        gerr = max(float((grads[n] - g).abs().max()) / max(float(g.abs().max()), floor) for n, g in ref_grads.items())
        if set(grads) != set(ref_grads) or abs(loss - ref_loss) > LOSS_TOL * max(1.0, abs(ref_loss)) or gerr > GRAD_TOL:
            shape = tuple(batch["input_ids"].shape)
            mismatches.append(f"cp={world_size} case {case}: batch {shape}, micro-batches {groups}, "
                              f"mask={'attention_mask' in batch}: loss {loss} vs {ref_loss}, grad rel err {gerr:.2e}")
    return mismatches


def _run(counts: dict[int, int]) -> None:
    failed, total = [], 0
    for world, n in counts.items():
        out = run_ranks(world, property_cases, n, deadline=600, pg_timeout=300)
        failed += out[0]
        total += n
    assert total >= 50
    assert not failed, f"{len(failed)} of {total} cases differ from one process:\n" + "\n".join(failed[:20])


def test_draws_cover_the_space():
    drawn = [draw(w, c) for w, n in SLOW_CASES.items() for c in range(n)]
    assert len({tuple(b["input_ids"].shape) for b, _ in drawn}) > 100
    assert any("attention_mask" in b and not bool(b["attention_mask"].all()) for b, _ in drawn)
    assert any(len(grp) > 1 for _, grp in drawn) and any((b["labels"] == -100).any() for b, _ in drawn)


def test_shard_batch_matches_one_process_on_random_cases():
    _run(DEFAULT_CASES)


@pytest.mark.slow
def test_shard_batch_matches_one_process_on_500_random_cases():
    _run(SLOW_CASES)
