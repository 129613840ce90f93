"""Sibling branches (preference pairs packed as [prompt | chosen | rejected]) under CP vs a single-process float64
reference with the dense sibling mask: world sizes 2 and 3, strategies ring, allgather, ulysses and usp (every
factoring of the world), zigzag and contiguous layouts, one pair in a row and two pairs packed in one row (a
1-token chosen, a 1-token rejected, a stretch of tokens outside the pairs), GQA heads; outputs and dq, dk, dv in
float64, and bf16 held to the error one device makes computing the same attention in bf16; ranks passing different
pairs get the same error. Each world size is spawned once and loops over its cases."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.parallel.layout import Branches, round_up
from tests.support.cp_reference import (
    branch_mask,
    check_vs_one_device,
    make_case,
    one_device,
    pattern_reference,
    rel_err,
    vs_one,
)
from tests.support.distributed import run_ranks

HEADS = (6, 2)  # GQA; 6 query heads split over 2 and 3 Ulysses ranks (over 3, K/V heads are replicated)
# (prompt_start, chosen_start, rejected_start, end) per pair
ROWS = {"one pair": ((0, 5, 11, 16),), "two pairs": ((0, 4, 5, 11), (11, 18, 23, 24))}
FP64_TOL = 1e-9


def grids(world_size: int) -> list[tuple[str, int | None]]:
    """(strategy, ulysses_size): ring, allgather, ulysses over the group, and usp at every factoring of it."""
    return [("ring", None), ("allgather", None), ("ulysses", None)] + \
        [("usp", u) for u in range(1, world_size + 1) if world_size % u == 0]


def _run(cp, strategy: str, spans, dtype: torch.dtype, seed: int, one: bool = False):
    """(errors vs float64 on this rank's shard[, vs_one(...)]) of CP attention over one row of these pairs."""
    branches = Branches(spans)
    n = round_up(branches.end + 1, 2 * cp.size)  # a stretch of tokens after the last pair, then to the multiple
    docs = branches.documents(n)
    q, k, v, dout = make_case(seed, 2, HEADS, n, 16, dtype)
    mask = branch_mask(n, spans)
    ref = pattern_reference(q, k, v, dout, mask)
    shard = lambda t: cp.shard(t, dim=2, documents=docs)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out = longdoc.attention(*leaves, cp, strategy=strategy, branches=branches)
    got = (out, *torch.autograd.grad(out, leaves, shard(dout)))
    names = ("out", "dq", "dk", "dv")
    errs = {name: rel_err(g, shard(r)) for name, g, r in zip(names, got, ref)}
    if not one:
        return errs
    base = one_device(q, k, v, dout, mask)
    return errs, vs_one(names, got, [shard(t) for t in base], [shard(t) for t in ref])


def _cases(rank: int, world_size: int) -> list[tuple[tuple, dict, dict | None]]:
    results = []
    for g_i, (strategy, u) in enumerate(grids(world_size)):
        for layout in ("zigzag", "contiguous"):
            cp = longdoc.ContextParallel(layout=layout, timeout=60, ulysses_size=u)
            label = f"{strategy}{u or ''}"
            for r_i, (row, spans) in enumerate(ROWS.items()):
                errs = _run(cp, strategy, spans, torch.float64, seed=100 * g_i + 10 * r_i + len(layout))
                results.append(((label, layout, row, "fp64"), errs, None))
            if layout == "zigzag" and strategy in ("ring", "ulysses"):
                errs, one = _run(cp, strategy, ROWS["two pairs"], torch.bfloat16, seed=7 + g_i, one=True)
                results.append(((label, layout, "two pairs", "bf16"), errs, one))
    return results, _disagree(rank)


def _disagree(rank: int) -> str:
    """The error of ranks passing different pairs (the chosen / rejected cut moves on rank 0 only)."""
    q = torch.randn(1, 6, 8, 16, dtype=torch.float64)
    try:
        longdoc.attention(q, q[:, :2], q[:, :2], longdoc.ContextParallel(timeout=60),
                          branches=[(0, 3 + (rank == 0), 6, 7)])
    except ValueError as e:
        return str(e)
    return "no error"


def _check(results, world_size: int) -> None:
    assert len(results) == 4 * len(grids(world_size)) + 2
    bad = [f"{case}: {errs}" for case, errs, _ in results if case[3] == "fp64"
           and not all(e <= FP64_TOL for e in errs.values())]  # `not <=` also catches NaN
    assert not bad, "float64 cases off the reference:\n" + "\n".join(bad)
    check_vs_one_device([r for r in results if r[2] is not None])


@pytest.mark.parametrize("world_size", [2, 3])
def test_branches_match_the_dense_sibling_mask(world_size):
    per_rank = run_ranks(world_size, _cases, deadline=300)
    for results, _ in per_rank:
        _check(results, world_size)
    errors = {e for _, e in per_rank}
    assert len(errors) == 1 and "CP ranks disagree" in errors.pop(), [e for _, e in per_rank]
