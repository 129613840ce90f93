"""CP attention vs single-process float64 SDPA: outputs and gradients, world sizes 1, 2, 4."""

from __future__ import annotations

import time

import pytest
import torch

import longdoc
from tests.support.cp_reference import cases, check_cases, run_case
from tests.support.distributed import run_ranks


def _gather_round_trip(cp) -> dict[str, float]:
    """gather(shard(x)) == x exactly on every rank; its gradient is the sum over ranks of their shards."""
    x = torch.arange(2 * 3 * cp.multiple * 4, dtype=torch.float64).reshape(2, 3 * cp.multiple, 4)
    local = cp.shard(x, dim=1).requires_grad_()
    full = cp.gather(local, dim=1)
    weight = torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape) * (cp.rank + 1)
    (grad,) = torch.autograd.grad((full * weight).sum(), local)
    expected = cp.shard(weight, dim=1) / (cp.rank + 1) * sum(r + 1 for r in range(cp.size))
    return {"gather": (full - x).abs().max().item(), "gather_grad": (grad - expected).abs().max().item()}


def _all_cases(rank: int, world_size: int) -> list[tuple[tuple, dict[str, float]]]:
    results = []
    for layout in ("zigzag", "contiguous"):
        errs = _gather_round_trip(longdoc.ContextParallel(layout=layout, timeout=60))
        results.append(((layout, "gather", None, None, "exact", None), errs))
    for i, case in enumerate(cases()):
        layout = case[0]
        cp = longdoc.ContextParallel(layout=layout, timeout=60)
        results.append((case, run_case(cp, case, seed=1000 + i)))
    return results


def test_world_size_1_in_process():
    torch.manual_seed(0)
    check_cases(_all_cases(0, 1), 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_reference(world_size):
    per_rank = run_ranks(world_size, _all_cases, deadline=600)
    assert len(per_rank[0]) == len(cases()) + 2 == 98
    for results in per_rank:
        check_cases(results, world_size)


# ---- failure modes: disagreement and hangs turn into errors on every rank -------------------------

def _disagree(rank: int, world_size: int, kind: str) -> str:
    cp = longdoc.ContextParallel(timeout=30)
    local = 8 if (kind != "length" or rank == 0) else 12
    q = torch.randn(1, 4, local, 16)
    k = torch.randn(1, 2, local, 16)
    if kind == "dims" and rank == 1:
        q = q[0]
    try:
        longdoc.attention(q, k, k.clone(), cp)
    except ValueError as e:
        return str(e)
    return "no error"


def _skip_call(rank: int, world_size: int, check_agreement: bool) -> float:
    cp = longdoc.ContextParallel(timeout=5, check_agreement=check_agreement)
    if rank == 1:
        time.sleep(12)  # never calls attention; stays alive so the others must time out on their own
        return -1.0
    q = torch.randn(1, 2, 8, 16)
    start = time.monotonic()
    try:
        longdoc.attention(q, q.clone(), q.clone(), cp)
    except RuntimeError:
        return time.monotonic() - start
    return float("inf")


def test_rank_disagreement_raises_same_error_everywhere():
    for kind, needle in (("length", "CP ranks disagree"), ("dims", "must be 4-D")):
        msgs = run_ranks(2, _disagree, kind, deadline=120)
        assert msgs[0] == msgs[1], msgs
        assert needle in msgs[0], msgs[0]


# with the agreement check on, the slow tier (the same timeout path; test_parallel_guard checks the check itself)
@pytest.mark.parametrize("check_agreement", [pytest.param(True, marks=pytest.mark.slow), False])
def test_missing_rank_becomes_error_within_60s(check_agreement):
    elapsed = run_ranks(2, _skip_call, check_agreement, deadline=120, pg_timeout=60)
    assert elapsed[1] == -1.0
    assert 0 < elapsed[0] < 60, f"rank 0 took {elapsed[0]}s to notice the missing rank"
