import pytest
import torch

from longdoc.parallel import layout as L


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_round_trip_is_exact_and_positions_match(layout, world_size):
    n = L.num_chunks(layout, world_size) * 5
    full = torch.arange(n)
    x = torch.randn(2, n, 3)
    parts = [L.shard(full, 0, r, world_size, layout) for r in range(world_size)]
    assert torch.equal(L.unshard(parts, 0, layout), full)
    assert torch.equal(L.unshard([L.shard(x, 1, r, world_size, layout) for r in range(world_size)], 1, layout), x)
    # every position exactly once, and positions() is the shard of arange
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    for r in range(world_size):
        assert torch.equal(L.positions(n, r, world_size, layout), parts[r])


def test_zigzag_holds_mirrored_chunks():
    # 2 ranks, 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert L.positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert L.positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert L.positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="layout must be one of 'zigzag', 'contiguous', got 'zz'"):
        L.num_chunks("zz", 2)
    with pytest.raises(ValueError, match=r"not divisible by 4 .*pad it to 12"):
        L.shard(torch.zeros(10), 0, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="rank must be in"):
        L.chunk_ids("zigzag", 2, 2)

