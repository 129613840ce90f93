"""Patched Hugging Face models under CP (gloo, 2 and 4 ranks) against single-process references.

One spawn per world size; every architecture and case runs inside it. Each rank computes the
single-process reference itself (unpatched twin model, full batch) and returns its errors; the
test process asserts, so a failure lists every (arch, case) at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4

# (name, batch, length, right-padded row lengths or None)
CASES = [
    ("divisible", 1, 48, None),
    ("not-divisible", 1, 45, None),
    ("right-padded-b2", 2, 43, (43, 29)),
]


def _batch(case, seed: int = 0) -> dict:
    _, bsz, length, lengths = case
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (bsz, length), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if lengths is not None:
        mask = torch.zeros(bsz, length, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        batch["attention_mask"] = mask
    return batch


def _reference(model, batch):
    """Single-process logits, loss and grads; pads are -100 in the labels (HF convention)."""
    labels = batch["labels"].clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _compare(model, cp, batch, ref, group=None) -> tuple[float, float, float]:
    """Errors of the CP step on `model` (patched with `cp`) against `ref` = (logits, loss, grads)."""
    ref_logits, ref_loss, ref_grads = ref
    model.zero_grad()
    local = cp.shard_batch(batch)
    out = model(**local)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    # grads: sum over the CP group (what a data-parallel all-reduce over the group does)
    grad_err = 0.0
    for n, p in model.named_parameters():
        if n not in ref_grads:
            assert p.grad is None or p.grad.abs().max() == 0, n
            continue
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=cp.group)
        grad_err = max(grad_err, ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item())
    # logits: this rank's shard of the reference, compared on real (non-padded) tokens only
    bsz, length = batch["input_ids"].shape
    padded = -(-length // cp.multiple) * cp.multiple
    real = torch.zeros(bsz, padded, dtype=torch.bool)
    real[:, :length] = batch.get("attention_mask", torch.ones(bsz, length)).bool()
    full = torch.zeros(bsz, padded, ref_logits.shape[-1])
    full[:, :length] = ref_logits
    want, keep = cp.shard(full, dim=1), cp.shard(real, dim=1)
    logit_err = (out.logits.detach() - want)[keep].abs().max().item()
    return logit_err, abs(loss.item() - ref_loss.item()), grad_err


def _rank_archs(rank: int, world_size: int) -> list[tuple]:
    import longdoc
    from longdoc import models

    torch.manual_seed(0)
    cp = longdoc.ContextParallel()
    results = []
    for arch in models.TINY_ARCHS:
        ref_model = models.tiny_model(arch, seed=1)
        model = longdoc.patch(models.tiny_model(arch, seed=1), cp)
        for case in CASES:
            batch = _batch(case)
            results.append((arch, case[0], *_compare(model, cp, batch, _reference(ref_model, batch))))
    # strategy "allgather", gradient checkpointing, and a sliding window >= the sequence (plain causal)
    batch = _batch(CASES[1])
    extra = [
        ("llama", "allgather", {}, "allgather", False),
        ("llama", "grad-checkpointing", {}, "ring", True),
        ("mistral", "window=48>=len", {"sliding_window": 48}, "ring", False),
        ("qwen2", "sliding-layers-window=64", {"use_sliding_window": True, "sliding_window": 64,
                                               "max_window_layers": 1}, "ring", False),
    ]
    for arch, name, overrides, strategy, checkpointing in extra:
        ref_model = models.tiny_model(arch, seed=2, **overrides)
        model = models.tiny_model(arch, seed=2, **overrides)
        if checkpointing:
            model.activation_checkpointing_enable()
            model.train()
        longdoc.patch(model, cp, strategy=strategy)
        results.append((arch, name, *_compare(model, cp, batch, _reference(ref_model, batch))))
    return results


def _rank_two_groups(rank: int, world_size: int) -> list[tuple]:
    """Two models patched with two different CP groups/layouts, called alternately, stay independent."""
    import longdoc
    from longdoc import models

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_world = longdoc.ContextParallel(layout="zigzag")
    cp_half = longdoc.ContextParallel(halves[rank // 2], layout="contiguous")
    ref_a, ref_b = models.tiny_model("llama", seed=3), models.tiny_model("qwen3", seed=4)
    a = longdoc.patch(models.tiny_model("llama", seed=3), cp_world)
    b = longdoc.patch(models.tiny_model("qwen3", seed=4), cp_half)
    results = []
    for step in range(2):
        batch = _batch(CASES[step], seed=step)
        results.append(("llama", f"world-zigzag-{step}", *_compare(a, cp_world, batch, _reference(ref_a, batch))))
        results.append(("qwen3", f"pair-contiguous-{step}", *_compare(b, cp_half, batch, _reference(ref_b, batch))))
    return results


def _rank_disagree(rank: int, world_size: int) -> str:
    """Rank 1 passes wrong position_ids: every rank must raise (no hang), rank 1 with the reason."""
    import longdoc
    from longdoc import models

    cp = longdoc.ContextParallel(timeout=20)
    model = longdoc.patch(models.tiny_model("llama"), cp)
    local = cp.shard_batch(_batch(CASES[0]))
    if rank == 1:
        local["position_ids"] = torch.arange(local["input_ids"].shape[1]).unsqueeze(0)
    try:
        model(**local)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _check(results: list[list[tuple]]) -> None:
    bad = []
    for rank_results in results:
        for arch, case, logit_err, loss_err, grad_err in rank_results:
            if not (logit_err <= LOGITS_TOL and loss_err <= LOSS_TOL and grad_err <= GRAD_TOL):
                bad.append(f"{arch}/{case}: logits {logit_err:.2e} loss {loss_err:.2e} grads {grad_err:.2e}")
    assert not bad, "CP differs from the single-process reference:\n" + "\n".join(bad)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_archs_match_single_process(world_size):
    results = run_ranks(world_size, _rank_archs, deadline=240, pg_timeout=60)
    from longdoc.models import TINY_ARCHS

    archs = {r[0] for r in results[0]}
    assert archs == set(TINY_ARCHS)
    assert len(results[0]) == len(TINY_ARCHS) * len(CASES) + 4
    _check(results)


def test_two_patched_models_with_different_groups_do_not_interfere():
    _check(run_ranks(4, _rank_two_groups, deadline=180, pg_timeout=60))


def test_bad_input_on_one_rank_fails_everywhere():
    messages = run_ranks(2, _rank_disagree, deadline=120, pg_timeout=60)
    assert "position_ids that are not this rank's global positions" in messages[1]
    assert "CP rank 1 rejected" in messages[0]
