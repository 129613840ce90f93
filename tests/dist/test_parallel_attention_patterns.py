"""Attention patterns under CP vs a single-process float64 reference: windows, chunked attention,
soft-capping, sinks, packed documents and their combinations; world sizes 1-4, both layouts, both
strategies, MHA/GQA/MQA, fp32 and bf16; outputs and every gradient (dsinks included).
Each world size is spawned once and loops over its cases."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.parallel.layout import Packed
from tests.support.cp_reference import check_cases, pattern_cases, run_pattern_case
from tests.support.distributed import run_ranks


def _cases(rank: int, world_size: int, full: bool) -> list[tuple[tuple, dict[str, float]]]:
    factory = lambda layout: longdoc.ContextParallel(layout=layout, timeout=60)  # noqa: E731
    results = []
    # packed rows: shard/gather round trip of arange is exact, and gather's gradient is the shard
    cp = factory("zigzag")
    packed = cp.pack(Packed((1, 5, 2 * world_size + 1, 1, 9)).pad_to(world_size))
    full_row = torch.arange(packed.seq_len, dtype=torch.float64)
    local = cp.shard(full_row, 0, documents=packed).requires_grad_()
    back = cp.gather(local, 0, documents=packed)
    (grad,) = torch.autograd.grad((back * full_row).sum(), local)
    results.append((("packed", "gather", "", "", "exact"),
                    {"gather": (back - full_row).abs().max().item(),
                     "grad": (grad - world_size * cp.shard(full_row, 0, documents=packed)).abs().max().item(),
                     "positions": (cp.positions(packed.seq_len, documents=packed).double() - local.detach())
                     .abs().max().item()}))
    for i, case in enumerate(pattern_cases(full)):
        results.append((case, run_pattern_case(factory, case, seed=2000 + i, world_size=world_size)))
    return results


def test_patterns_world_size_1_in_process():
    check_cases(_cases(0, 1, False), 1)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_patterns_match_reference(world_size):
    per_rank = run_ranks(world_size, _cases, False, deadline=600)
    assert len(per_rank[0]) == len(pattern_cases()) + 1
    for results in per_rank:
        check_cases(results, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_patterns_full_matrix(world_size):
    for results in run_ranks(world_size, _cases, True, deadline=1800):
        check_cases(results, world_size)


def _disagree(rank: int, world_size: int, kind: str) -> str:
    cp = longdoc.ContextParallel(timeout=30)
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    kwargs = {
        "window": {"window": 5 + rank},
        "sinks": {"sinks": torch.zeros(4 if rank == 0 else 3)},
        "documents": {"documents": (8, 8) if rank == 0 else (4, 12)},
    }[kind]
    try:
        longdoc.attention(q, k, k.clone(), cp, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


def test_pattern_disagreement_raises_same_error_everywhere():
    for kind, needle in (("window", "CP ranks disagree"), ("sinks", "sinks must have shape (q_heads,) = (4,)"),
                         ("documents", "CP ranks disagree")):
        msgs = run_ranks(2, _disagree, kind, deadline=120)
        assert msgs[0] == msgs[1], msgs
        assert needle in msgs[0], msgs[0]
