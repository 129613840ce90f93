import itertools

import pytest
import torch

from longdoc.parallel import blocks
from longdoc.parallel import layout as L


def test_merge_with_neg_inf_lse_is_exact_and_never_nan():
    out = torch.zeros(3, 4)
    lse = torch.full((3,), float("-inf"))
    blk = torch.randn(3, 4)
    blk_lse = torch.tensor([0.5, float("-inf"), 2.0])  # row 1: block with no visible key
    new_out, new_lse = blocks.merge(out, lse, blk, blk_lse)
    assert torch.equal(new_out[[0, 2]], blk[[0, 2]])  # nothing seen before: the block is the result
    assert torch.equal(new_out[1], torch.zeros(4)) and new_lse[1] == float("-inf")
    assert not torch.isnan(new_out).any()
    # merging a fully masked block into a seen row changes nothing
    again_out, again_lse = blocks.merge(new_out, new_lse, torch.randn(3, 4), torch.full((3,), float("-inf")))
    assert torch.equal(again_out, new_out) and torch.equal(again_lse, new_lse)


def test_merge_equals_softmax_over_union():
    s = torch.randn(5, 12, dtype=torch.float64)
    v = torch.randn(12, 3, dtype=torch.float64)
    full = torch.softmax(s, -1) @ v
    out, lse = torch.zeros(5, 3, dtype=torch.float64), torch.full((5,), float("-inf"), dtype=torch.float64)
    for cols in (slice(0, 4), slice(4, 9), slice(9, 12)):
        part = s[:, cols]
        out, lse = blocks.merge(out, lse, torch.softmax(part, -1) @ v[cols], torch.logsumexp(part, -1))
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def _coverage(layout, world_size, causal, chunk=3):
    """Count how often each (query, key) cell of the full matrix is computed over all ranks and steps."""
    n = chunk * L.num_chunks(layout, world_size)
    count = torch.zeros(n, n, dtype=torch.long)
    local = n // world_size
    work = torch.zeros(world_size, world_size, dtype=torch.long)
    for rank, step in itertools.product(range(world_size), range(world_size)):
        src = (rank - step) % world_size
        qpos, kpos = L.positions(n, rank, world_size, layout), L.positions(n, src, world_size, layout)
        for rows, cols, blk_causal in blocks.ring_plan(layout, rank, src, world_size, local, causal):
            cell = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.long)
            if blk_causal:
                cell = cell.tril()
            count[qpos[rows].unsqueeze(1), kpos[cols].unsqueeze(0)] += cell
            work[step, rank] += cell.sum()
    return count, work


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_plan_covers_each_visible_cell_once_and_no_masked_cell(layout, world_size, causal):
    count, work = _coverage(layout, world_size, causal)
    n = count.shape[0]
    expected = torch.ones(n, n, dtype=torch.long)
    assert torch.equal(count, expected.tril() if causal else expected)
    if layout == "zigzag" or not causal:
        # load balance: at every step all ranks compute the same number of cells
        assert (work == work[:, :1]).all(), work


def test_prefix_plan_covers_causal_prefix():
    for world_size, layout in itertools.product((1, 2, 4), L.LAYOUTS):
        chunk, n = 3, 3 * L.num_chunks(layout, world_size)
        count = torch.zeros(n, n, dtype=torch.long)
        for rank in range(world_size):
            ids = L.chunk_ids(layout, rank, world_size)
            qpos = L.positions(n, rank, world_size, layout)
            for rows, cols, c in blocks.prefix_plan(ids, chunk, n, True):
                cell = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.long)
                count[qpos[rows].unsqueeze(1), torch.arange(cols.start, cols.stop).unsqueeze(0)] += (
                    cell.tril(cols.stop - cols.start - (rows.stop - rows.start)) if c else cell)
        assert torch.equal(count, torch.ones(n, n, dtype=torch.long).tril())
