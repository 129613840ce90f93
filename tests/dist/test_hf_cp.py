"""Patched Hugging Face models under CP (gloo, 2 and 4 ranks) against single-process references.

One spawn per world size; every architecture and case runs inside it. Each rank computes the
single-process reference itself (unpatched twin model, full batch) and returns its errors; the
test process asserts, so a failure lists every (arch, case) at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longdoc.parallel.layout import round_up
from tests.support.distributed import run_ranks
from tests.support.hf_cases import CASES, cp_step_errors, padded_batch, reference_step
from tests.support.hf_families import LOGITS_TOL, check_model_errors


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
            batch = padded_batch(case)
            results.append((arch, case[0], *cp_step_errors(model, cp, batch, reference_step(ref_model, batch))))
    # strategy "allgather", gradient checkpointing, and a sliding window >= the sequence (plain causal)
    batch = padded_batch(CASES[1])
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
        results.append((arch, name, *cp_step_errors(model, cp, batch, reference_step(ref_model, batch))))
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
        batch = padded_batch(CASES[step], seed=step)
        results.append(("llama", f"world-zigzag-{step}",
                        *cp_step_errors(a, cp_world, batch, reference_step(ref_a, batch))))
        results.append(("qwen3", f"pair-contiguous-{step}",
                        *cp_step_errors(b, cp_half, batch, reference_step(ref_b, batch))))
    return results


def _rank_prefill(rank: int, world_size: int) -> dict[str, float]:
    """prefill's local logits, logits at chosen positions, span log-probs and gather_positions."""
    import longdoc
    from longdoc import models
    from longdoc.hf.prefill import gather_positions, prefill, span_logprobs, target_logprobs

    cp = longdoc.ContextParallel()
    errors = {}
    for arch in ("llama", "qwen2_moe"):
        batch = {"input_ids": padded_batch(CASES[2])["input_ids"]}  # batch 2, 43 tokens (not divisible)
        ref = models.tiny_model(arch, seed=5)(**batch).logits.detach()
        model = longdoc.patch(models.tiny_model(arch, seed=5), cp)
        local = prefill(model, cp, batch)
        padded = round_up(43, cp.multiple)
        full = torch.zeros(2, padded, ref.shape[-1])
        full[:, :43] = ref
        pos = [42, 0, 17, 30]
        per_row = torch.tensor([[5, 41], [40, 2]])
        ids = batch["input_ids"]
        want_span = torch.log_softmax(ref[:, 35:42], -1).gather(2, ids[:, 36:43, None]).squeeze(2)
        want_rows = torch.stack([ref[0, [5, 41]], ref[1, [40, 2]]])
        errors[arch] = max(
            (local - cp.shard(full, dim=1))[:, cp.shard(torch.arange(padded) < 43, 0)].abs().max(),
            (prefill(model, cp, batch, positions=pos) - ref[:, pos]).abs().max(),
            (prefill(model, cp, batch, positions=per_row) - want_rows).abs().max(),
            (gather_positions(local, cp, pos) - ref[:, pos]).abs().max(),
            (span_logprobs(model, cp, batch, 36, 43) - want_span).abs().max(),
            (target_logprobs(model, cp, batch, [42], ids[:, :1]) -
             torch.log_softmax(ref[:, 42], -1).gather(1, ids[:, :1])).abs().max(),
        ).item()
    return errors


def _rank_disagree(rank: int, world_size: int) -> str:
    """Rank 1 passes wrong position_ids: every rank must raise (no hang), rank 1 with the reason."""
    import longdoc
    from longdoc import models

    cp = longdoc.ContextParallel(timeout=20)
    model = longdoc.patch(models.tiny_model("llama"), cp)
    local = cp.shard_batch(padded_batch(CASES[0]))
    if rank == 1:
        local["position_ids"] = torch.arange(local["input_ids"].shape[1]).unsqueeze(0)
    try:
        model(**local)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank_main(rank: int, world_size: int) -> dict:
    out = {"archs": _rank_archs(rank, world_size)}
    if world_size == 4:
        out["groups"] = _rank_two_groups(rank, world_size)
    else:
        out["prefill"] = _rank_prefill(rank, world_size)
        out["content"] = _rank_content(rank, world_size)
        out["disagree"] = _rank_disagree(rank, world_size)  # last: it leaves the ranks after an error
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def ranks(request):
    """One spawn per world size; the tests below read its per-rank results."""
    return request.param, run_ranks(request.param, _rank_main, deadline=300, pg_timeout=60)


def test_tiny_archs_match_single_process(ranks):
    from longdoc.models import TINY_ARCHS

    _, results = ranks
    archs = [r["archs"] for r in results]
    assert {r[0] for r in archs[0]} == set(TINY_ARCHS)
    assert len(archs[0]) == len(TINY_ARCHS) * len(CASES) + 4
    check_model_errors(archs)


def test_two_patched_models_with_different_groups_do_not_interfere(ranks):
    world_size, results = ranks
    if world_size != 4:
        pytest.skip("runs in the 4-rank spawn")
    check_model_errors([r["groups"] for r in results])


def test_prefill_logits_positions_and_span_logprobs(ranks):
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("runs in the 2-rank spawn")
    for r in results:
        assert max(r["prefill"].values()) <= LOGITS_TOL, r["prefill"]


def test_bad_input_on_one_rank_fails_everywhere(ranks):
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("runs in the 2-rank spawn")
    assert "position_ids that are not this rank's global positions" in results[1]["disagree"]
    assert "CP rank 1 rejected" in results[0]["disagree"]


# ---- content agreement: ranks of one CP group must hold the same batch ----

def _rank_content(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 changes one field of an otherwise identical batch; every rank must raise the same error."""
    import longdoc

    cp = longdoc.ContextParallel(timeout=20)
    base = padded_batch(CASES[2])  # batch 2, right-padded: input_ids, labels, attention_mask
    variants = {"same": {}, "ids": {"input_ids": 1}, "labels": {"labels": 1}, "mask": {"attention_mask": 1},
                "shape": {"extra": 1}}
    out = {}
    for name, change in variants.items():
        batch = {k: v.clone() for k, v in base.items()}
        if rank == 1 and "input_ids" in change:
            batch["input_ids"][1, 5] += 1  # same shape, one token different
        if rank == 1 and "labels" in change:
            batch["labels"][0, 7] = -100
        if rank == 1 and "attention_mask" in change:
            batch["attention_mask"][1, 25:] = 0  # still right padding, a shorter second row
        if rank == 1 and "extra" in change:
            batch = {k: v[:, :40] for k, v in batch.items()}
        try:
            local = cp.shard_batch(batch)
            out[name] = f"ok {tuple(local['input_ids'].shape)}"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"
    unchecked = longdoc.ContextParallel(timeout=20, check_agreement=False)
    batch = {k: v.clone() for k, v in base.items()}
    batch["input_ids"][0, 0] += rank
    out["unchecked"] = f"ok {tuple(unchecked.shard_batch(batch)['input_ids'].shape)}"
    return out


def _named(error: str) -> str:
    """The fields an agreement error names: '... different batches: <fields> differ(s) between ...'."""
    return error.split("different batches: ", 1)[1].split(" differ", 1)[0]


def test_ranks_holding_different_batches_all_raise_the_same_error(ranks):
    world_size, results = ranks
    if world_size != 2:
        pytest.skip("runs in the 2-rank spawn")
    r0, r1 = (r["content"] for r in results)
    assert r0["same"] == r1["same"] == "ok (2, 22)"
    assert r0["unchecked"] == r1["unchecked"] == "ok (2, 22)"
    for case, field in (("ids", "input_ids"), ("labels", "labels"), ("mask", "attention_mask"),
                        ("shape", "input_ids")):
        assert r0[case] == r1[case], f"{case}: the ranks raised different errors:\n{r0[case]}\n{r1[case]}"
        assert r0[case].startswith("CPInputError: cp.shard_batch: the CP ranks hold different batches: "), r0[case]
        assert field in _named(r0[case]), r0[case]
        assert "sample per data-parallel replica, not per rank" in r0[case]
    assert _named(r0["ids"]) == "input_ids" and _named(r0["labels"]) == "labels"
    assert _named(r0["mask"]) == "attention_mask"
    assert "input_ids rank 0: (2, 43) int64, rank 1: (2, 40) int64" in r0["shape"]
