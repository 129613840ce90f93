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


# ---- pattern plans: windows, chunks, documents ---------------------------------------------------

from longdoc.parallel import masks as M  # noqa: E402
from tests.support.cp_reference import pattern_mask  # noqa: E402


def _pattern_coverage(layout, world_size, n, pattern):
    """(count of computations per cell, cells computed incl. masked ones) over all ranks and steps."""
    runs = blocks.all_runs(layout, world_size, n, pattern)
    count = torch.zeros(n, n, dtype=torch.long)
    computed = 0
    for rank, src in itertools.product(range(world_size), range(world_size)):
        qpos = L.shard_runs(torch.arange(n), 0, runs[rank])
        kpos = L.shard_runs(torch.arange(n), 0, runs[src])
        for b in blocks.ring_blocks(layout, rank, src, world_size, n // world_size, pattern):
            rows, cols = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
            hidden = M.band_hidden(rows, cols, b.band, b.causal)
            cell = torch.ones(rows, cols, dtype=torch.long) if hidden is None else (~hidden).long()
            assert (cell.sum(1) > 0).all(), f"block {b} has a row that sees none of its keys"
            count[qpos[b.rows].unsqueeze(1), kpos[b.cols].unsqueeze(0)] += cell
            computed += rows * cols
    return count, computed


PLAN_CASES = [
    dict(window=w, chunk_size=c, doc_lens=d, causal=causal)
    for w, c, d, causal in itertools.product((None, 1, 2, 5, 13, 1000), (None, 4, 7), (None, (1, 9, 1, 2, 11)),
                                             (True, False))
    if causal or w is None
]


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_pattern_plan_covers_each_visible_cell_exactly_once(layout, world_size):
    n = 24
    for spec in PLAN_CASES:
        docs = L.Packed(spec["doc_lens"]) if spec["doc_lens"] else None
        pattern = M.Pattern(spec["causal"], spec["window"], spec["chunk_size"], None, docs).normalized(n)
        count, _ = _pattern_coverage(layout, world_size, n, pattern)
        want = pattern_mask(n, spec["causal"], spec["window"], spec["chunk_size"], spec["doc_lens"]).long()
        assert torch.equal(count, want), (layout, world_size, spec)


def test_window_work_is_skipped_not_masked():
    # a window of 1/8 of the sequence: the cells computed (masked ones included) stay within ~1.25x
    # of the visible band (quarter-window tiles), so the work is ~1/3 of causal, not all of it
    n, w = 2048, 256
    pattern = M.Pattern(True, w)
    _, computed = _pattern_coverage("zigzag", 2, n, pattern)
    visible = pattern_mask(n, True, w).sum().item()
    assert computed <= 1.3 * visible, (computed, visible)
    assert computed <= 0.35 * n * (n + 1) / 2


def test_ring_stops_when_no_rank_needs_more_blocks():
    n = 64
    # contiguous, window shorter than a rank's part: only the previous rank's keys are ever needed
    assert blocks.ring_steps("contiguous", 4, n // 4, M.Pattern(True, 8)) == 2
    assert blocks.ring_steps("contiguous", 4, n // 4, M.Pattern(True, 17)) == 2  # i = 32 sees 16..32
    assert blocks.ring_steps("contiguous", 4, n // 4, M.Pattern(True, 18)) == 3
    # documents each inside one rank's part under the contiguous layout: no exchange at all
    assert blocks.ring_steps("contiguous", 4, n // 4, M.Pattern(True, None, None, None, L.Packed((16,) * 4))) == 1
    assert blocks.ring_steps("contiguous", 4, n // 4, M.Pattern(True)) == 4


def test_off_by_one_window_is_caught_by_the_reference():
    # mutation check: a window that lets one key too many through must fail the comparison
    import longdoc
    from tests.support.cp_reference import make_case, pattern_reference, rel_err

    q, k, v, dout = make_case(0, 1, (2, 1), 24, 8, torch.float32)
    ref = pattern_reference(q, k, v, dout, pattern_mask(24, True, 5))
    cp = longdoc.ContextParallel()
    good = longdoc.attention(q, k, v, cp, window=5)
    assert rel_err(good, ref[0]) <= 1e-5
    original = M._lo
    try:
        M._lo = lambda i, window: original(i, window) - 1
        M.plan.cache_clear(), blocks.ring_blocks.cache_clear(), blocks.ring_steps.cache_clear()
        bad = longdoc.attention(q, k, v, cp, window=5)
    finally:
        M._lo = original
        M.plan.cache_clear(), blocks.ring_blocks.cache_clear(), blocks.ring_steps.cache_clear()
    assert rel_err(bad, ref[0]) > 1e-2
