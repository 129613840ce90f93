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



# ---- packed rows: per-document zigzag --------------------------------------------------------------

DOC_SETS = [(1,), (1, 1, 1, 1, 1, 1, 1, 1), (7, 1, 12, 3, 1), (40,), (2, 37, 1, 1, 5, 19, 3)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("doc_lens", DOC_SETS)
@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_packed_round_trip_is_exact(world_size, doc_lens, layout):
    packed = L.Packed(doc_lens).pad_to(world_size)
    n = packed.seq_len
    full = torch.arange(n)
    parts = [packed.shard(full, 0, r, world_size, layout) for r in range(world_size)]
    assert len({p.numel() for p in parts}) == 1  # equal local lengths: ring messages have one shape
    assert torch.equal(packed.unshard(parts, 0, layout), full)
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    for r, p in enumerate(parts):
        assert torch.equal(packed.positions(r, world_size, layout), p)
        assert p.tolist() == sorted(p.tolist())  # local order is global order
    x = torch.randn(2, n, 3)
    assert torch.equal(packed.unshard([packed.shard(x, 1, r, world_size, layout) for r in range(world_size)], 1,
                                      layout), x)


def test_packed_is_per_document_zigzag():
    # 2 ranks, documents of 8 and 4: each cut into 4 chunks, rank r gets chunks r and 3 - r of each
    p = L.Packed((8, 4))
    assert p.positions(0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    assert p.positions(1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    assert p.position_ids().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]


def _work(packed: L.Packed, world_size: int) -> list[int]:
    """Causal attention work (visible cells) of each rank: a token at document position p sees p + 1 keys."""
    pos_in_doc = packed.position_ids()
    return [int((pos_in_doc[packed.positions(r, world_size)] + 1).sum()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_work_is_balanced_for_mixed_lengths(world_size):
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        lens, total = [], 0
        while total < 32768 - 8192:
            n = int(torch.randint(1, 8193, (1,), generator=g))
            lens.append(n)
            total += n
        lens.append(32768 - total)
        work = _work(L.Packed(tuple(lens)), world_size)
        assert max(work) / (sum(work) / world_size) <= 1.05, work


def test_packed_errors_name_the_fix():
    with pytest.raises(ValueError, match="positive ints"):
        L.Packed((3, 0))
    with pytest.raises(ValueError, match=r"not a multiple of the 2 CP ranks; pad it with Packed.pad_to\(2\)"):
        L.Packed((3, 4)).shard(torch.zeros(7), 0, 0, 2)
    with pytest.raises(ValueError, match="doc_lens sum to 8"):
        L.Packed((4, 4)).shard(torch.zeros(10), 0, 0, 2)
    assert L.Packed((3, 4)).pad_to(4).doc_lens == (3, 4, 1)


def test_packed_from_hf_position_ids():
    p = L.Packed((3, 1, 4))
    assert L.Packed.from_position_ids(p.position_ids()) == p
    assert L.Packed.from_position_ids([0, 1, 0, 0, 1]).doc_lens == (2, 1, 2)
    for bad in ([1, 2], [0, 2], [], [0, 1, 1]):
        with pytest.raises(ValueError, match="position_ids must start at 0"):
            L.Packed.from_position_ids(bad)
