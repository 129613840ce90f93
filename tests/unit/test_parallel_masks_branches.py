"""Sibling branches (preference pairs packed as [prompt | chosen | rejected]): masks.plan over random branch
layouts covers every visible cell of the dense sibling mask exactly once and no hidden cell, for every rank pair
(the ring's steps) and for all-gather's plan; plus the Branches checks and the refusals of longdoc.attention."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import longdoc
from longdoc.parallel import blocks
from longdoc.parallel import layout as L
from longdoc.parallel import masks as M
from tests.support.cp_reference import branch_mask


def _random_row(rng: random.Random, world: int) -> tuple[int, L.Branches]:
    """1-3 pairs (chosen / rejected of 1 token sometimes), optional gaps between them, padded to 2 * world."""
    spans, pos = [], rng.choice((0, 0, 2))
    for _ in range(rng.randint(1, 3)):
        p, c, r = (rng.choice((1, 1, 2, 5, 9)) for _ in range(3))
        spans.append((pos, pos + p, pos + p + c, pos + p + c + r))
        pos += p + c + r + rng.choice((0, 0, 1, 3))
    return L.round_up(pos, 2 * world), L.Branches(tuple(spans))


def _coverage(layout: str, world: int, n: int, pattern: M.Pattern) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of computations per cell over every rank and ring step, the same over all-gather's plans)."""
    runs = blocks.all_runs(layout, world, n, pattern)
    ring, gather = torch.zeros(n, n, dtype=torch.long), torch.zeros(n, n, dtype=torch.long)
    for rank in range(world):
        qpos = L.shard_runs(torch.arange(n), 0, runs[rank])
        plans = [(blocks.ring_blocks(layout, rank, src, world, n // world, pattern),
                  L.shard_runs(torch.arange(n), 0, runs[src]), ring) for src in range(world)]
        plans.append((blocks.gather_blocks(layout, rank, world, n // world, pattern), torch.arange(n), gather))
        for plan, kpos, count in plans:
            for b in plan:
                rows, cols = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
                hidden = M.band_hidden(rows, cols, b.band, b.causal)
                cell = torch.ones(rows, cols, dtype=torch.long) if hidden is None else (~hidden).long()
                assert (cell.sum(1) > 0).all(), f"block {b} has a row that sees none of its keys"
                count[qpos[b.rows].unsqueeze(1), kpos[b.cols].unsqueeze(0)] += cell
    return ring, gather


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_covers_every_visible_sibling_cell_exactly_once(layout, world):
    rng = random.Random(17 * world + len(layout))
    for _ in range(25):
        n, branches = _random_row(rng, world)
        for docs in (branches.documents(n), None):  # per-pair zigzag, and the plain layout (plan holds for any)
            pattern = M.Pattern(True, documents=docs, branches=branches)
            want = branch_mask(n, branches.spans).long()
            ring, gather = _coverage(layout, world, n, pattern)
            assert torch.equal(ring, want), (layout, world, n, branches, docs)
            assert torch.equal(gather, want), (layout, world, n, branches, docs)


def test_the_reference_mask_is_the_definition():
    # one pair [0, 2) prompt, [2, 4) chosen, [4, 6) rejected, then a 2-token document of its own
    vis = branch_mask(8, ((0, 2, 4, 6),))
    assert vis[3].tolist() == [True, True, True, True, False, False, False, False]
    assert vis[5].tolist() == [True, True, False, False, True, True, False, False]
    assert vis[7].tolist() == [False] * 6 + [True, True]


def test_rejected_never_plans_a_block_of_chosen_keys():
    branches = L.Branches(((0, 4, 8, 12),))
    pattern = M.Pattern(True, documents=branches.documents(12), branches=branches)
    for blk in M.plan(((8, 4),), ((0, 12),), 12, pattern):
        assert not (blk.cols.start < 8 and blk.cols.stop > 4), blk
    assert not M.plan(((8, 4),), ((4, 4),), 12, pattern)  # the whole chosen piece hidden: no block at all


def test_branches_checks():
    b = L.Branches([[2, 4, 5, 6], [6, 7, 9, 10]])
    assert b.spans == ((2, 4, 5, 6), (6, 7, 9, 10))
    assert b.documents(12).doc_lens == (2, 4, 4, 2)
    assert b.position_ids(12).tolist() == [0, 1, 0, 1, 2, 2, 0, 1, 2, 1, 0, 1]
    b.check(b.documents(12))
    with pytest.raises(ValueError, match="not one document"):
        b.check(L.Packed((12,)))
    with pytest.raises(ValueError, match="past the row"):
        b.documents(9)
    for bad in ([], [(0, 0, 1, 2)], [(0, 1, 2, 2)], [(0, 1, 2, 3), (2, 3, 4, 5)], [(0, 1.0, 2, 3)], [(0, 1, 2)],
                [(-1, 1, 2, 3)], [(0, True, 2, 3)], 5):
        with pytest.raises(ValueError, match="branches: spans must be"):
            L.Branches(bad)


@pytest.mark.parametrize("kwargs, needle", [
    ({"causal": False}, "branches need causal=True"),
    ({"window": 3}, "branches with a sliding window"),
    ({"chunk_size": 4}, "branches with chunked attention"),
    ({"branches": [(0, 1, 2, 40)]}, "past the row"),
    ({"branches": [(0, 1, 1, 4)]}, "branches: spans must be"),
    ({"documents": (2, 14)}, "not one document"),
    ({"selected": torch.zeros(1, 16, 2, dtype=torch.long)}, "branches with selected keys"),
])
def test_attention_refuses_by_name(kwargs, needle):
    q = torch.randn(1, 2, 16, 8)
    kwargs = {"branches": [(0, 3, 8, 12)], **kwargs}
    with pytest.raises(ValueError, match=needle):
        longdoc.attention(q, q, q, longdoc.ContextParallel(), **kwargs)


def test_one_process_attention_equals_the_dense_mask():
    from tests.support.cp_reference import make_case, pattern_reference, rel_err

    spans = ((0, 3, 7, 9), (9, 12, 13, 20))
    q, k, v, dout = make_case(5, 2, (4, 2), 24, 8, torch.float64)
    ref = pattern_reference(q, k, v, dout, branch_mask(24, spans))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = longdoc.attention(*leaves, longdoc.ContextParallel(), branches=spans)
    grads = torch.autograd.grad(out, leaves, dout)
    for got, want in itertools.zip_longest((out, *grads), ref):
        assert rel_err(got, want) < 1e-7
