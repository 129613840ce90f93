"""The metadata of the Ulysses strategies, in one process: head ranges, token maps of a factored group, the
bytes-per-rank formulas, and the refusals that happen before any communication."""

from __future__ import annotations

import itertools

import pytest
import torch

import longdoc
from longdoc.parallel import layout as layouts
from longdoc.parallel.layout import Packed
from longdoc.parallel.traffic import bytes_sent
from longdoc.parallel.ulysses import split_heads, token_map


@pytest.mark.parametrize("q_heads,kv_heads,size", [(h, kv, p) for h, kv, p in itertools.product(
    (4, 8, 9, 12, 28), (1, 2, 3, 4, 8), (1, 2, 3, 4, 8)) if h % kv == 0 and h >= p])
def test_head_ranges_cover_every_head_evenly_and_send_only_the_kv_heads_read(q_heads, kv_heads, size):
    heads = split_heads(q_heads, kv_heads, size)
    assert heads.q[0][0] == 0 and heads.q[-1][1] == q_heads
    assert all(a[1] == b[0] for a, b in zip(heads.q, heads.q[1:]))  # contiguous, disjoint
    widths = [b - a for a, b in heads.q]
    assert min(widths) >= 1 and max(widths) - min(widths) <= 1
    group = q_heads // kv_heads
    for u, ((a, b), (ka, kb)) in enumerate(zip(heads.q, heads.kv)):
        assert set(range(ka, kb)) == {h // group for h in range(a, b)}  # exactly the K/V heads read
        idx = heads.kv_index(u)
        local = idx if idx is not None else [i // ((b - a) // (kb - ka)) for i in range(b - a)]
        assert [ka + j for j in local] == [h // group for h in range(a, b)]  # each query head meets its K/V head
    assert heads.replicated == (sum(kb - ka for ka, kb in heads.kv) > kv_heads)


def test_smollm2_heads_over_2_and_4_ranks():
    two, four = split_heads(9, 3, 2), split_heads(9, 3, 4)
    assert two.q == ((0, 4), (4, 9)) and two.kv == ((0, 2), (1, 3)) and two.replicated
    assert two.kv_index(0) == (0, 0, 0, 1)  # 4 query heads over 2 K/V heads, not GQA's grouping: expanded
    assert four.q == ((0, 2), (2, 4), (4, 6), (6, 9)) and all(four.kv_index(u) is None for u in range(4))


@pytest.mark.parametrize("layout,ring_size,size", [(lay, r, u) for lay in layouts.LAYOUTS for r in (1, 2, 3)
                                                   for u in (1, 2, 4)])
def test_plain_layouts_read_over_consecutive_ranks_are_the_ring_layout(layout, ring_size, size):
    """The claim usp rests on: P-way zigzag (contiguous) grouped by U consecutive ranks is R-way zigzag
    (contiguous), so the ring plans with its ordinary layout (ring_runs None)."""
    n = 8 * layouts.num_chunks(layout, ring_size * size)
    for r in range(ring_size):
        tokens = token_map(layout, ring_size, size, r, n)
        assert tokens.ring_runs is None
        union = sorted(p for rs in tokens.members for p in rs)
        want = layouts.positions(n, r, ring_size, layout).tolist()
        assert [i for s, k in union for i in range(s, s + k)] == want


@pytest.mark.parametrize("docs", [(7, 9, 12, 4), (1, 17, 3, 1, 2, 1, 3), (5, 11, 3, 13), (32,)])
def test_token_map_round_trips_the_group_tokens(docs):
    """Members' shards -> the group's tensor in global order -> back to every member: exact, for packed rows."""
    packed = Packed(docs).pad_to(4)
    n = packed.seq_len
    full = torch.arange(n)
    for ring_size, size in ((2, 2), (1, 4), (4, 1)):
        for r in range(ring_size):
            tokens = token_map("zigzag", ring_size, size, r, n, packed)
            shards = [packed.shard(full, 0, r * size + u, ring_size * size) for u in range(size)]
            group = layouts.unshard_runs(shards, 0, list(tokens.members))
            ring_runs = tokens.ring_runs or tuple(layouts.runs("zigzag", i, ring_size, n, packed)
                                                  for i in range(ring_size))
            assert group.tolist() == [i for s, k in ring_runs[r] for i in range(s, s + k)]  # sorted, ring's pieces
            for u in range(size):
                assert torch.equal(layouts.shard_runs(group, 0, tokens.local[u]), shards[u])


def test_bytes_sent_shrink_with_p_for_ulysses_and_not_for_the_ring():
    def total(strategy, p, **kw):
        return bytes_sent(strategy, cp_size=p, seq_len=1 << 15, q_heads=8, kv_heads=8, head_dim=64, itemsize=2,
                          **kw).total
    assert [total("ring", p) for p in (1,)] == [0] and total("ulysses", 1) == 0
    uly = [total("ulysses", p) for p in (2, 4, 8)]
    ring = [total("ring", p) for p in (2, 4, 8)]
    assert uly[0] > uly[1] > uly[2] and ring[0] < ring[1] < ring[2]
    assert total("usp", 4, ulysses_size=1) == total("ring", 4)  # 1 x 4 is the ring
    assert total("usp", 4, ulysses_size=4) == total("ulysses", 4)  # 4 x 1 is Ulysses
    with pytest.raises(ValueError, match="usp needs ulysses_size"):
        bytes_sent("usp", cp_size=4, seq_len=64, q_heads=4, kv_heads=4, head_dim=8, itemsize=2)


def test_single_process_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"ulysses_size must be a divisor of the CP group size 1 \(\[1\]\), got 2"):
        longdoc.ContextParallel(ulysses_size=2)
    cp = longdoc.ContextParallel()
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="strategy='usp' factors the CP group"):
        longdoc.attention(q, q, q, cp, strategy="usp")
    from longdoc.models import tiny_model

    with pytest.raises(ValueError, match="create it with ContextParallel"):
        longdoc.patch(tiny_model("llama"), cp, strategy="usp")
    assert longdoc.ContextParallel(ulysses_size=1).ring_size == 1
    out = longdoc.attention(q, q, q, longdoc.ContextParallel(ulysses_size=1), strategy="usp")
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert (out - ref).abs().max() < 1e-6
    # selected-key (DSA) attention is not built for the head all-to-all: refused by name, before any collective
    selected = torch.zeros(1, 8, 2, dtype=torch.long)
    for strategy in ("ulysses", "usp"):
        with pytest.raises(ValueError, match=f"strategy 'ring' or 'allgather', not '{strategy}'"):
            longdoc.attention(q, q, q, longdoc.ContextParallel(ulysses_size=1), strategy=strategy, selected=selected)


def test_trainer_recipe_and_planner_checks():
    from longdoc.hf.trainer import check_ulysses_size
    from longdoc.plan.planner import PlanRequest
    from longdoc.train.config import RecipeError, recipe_from_dict

    with pytest.raises(ValueError, match=r"cp_strategy='usp' factors cp_size=4 .* one of \[1, 2, 4\]"):
        check_ulysses_size("usp", None, 4)
    with pytest.raises(ValueError, match="cp_ulysses_size only applies to cp_strategy='usp'"):
        check_ulysses_size("ring", 2, 4)
    check_ulysses_size("usp", 2, 4)
    base = {"data": {"path": "random"}, "parallelism": {"cp_size": 4}}
    with pytest.raises(RecipeError, match=r"parallelism.ulysses_size: goes with parallelism.strategy=usp, which "
                                          r"factors cp_size=4 .* "
                                          r"one of \[1, 2, 4\]\) or neither; got None with 'usp'"):
        recipe_from_dict(base, ["parallelism.strategy=usp"])
    with pytest.raises(RecipeError,
                       match=r"parallelism.ulysses_size: must be a divisor of cp_size=4 \(\[1, 2, 4\]\), got 3"):
        recipe_from_dict(base, ["parallelism.strategy=usp", "parallelism.ulysses_size=3"])
    with pytest.raises(RecipeError,
                       match="parallelism.ulysses_size: goes with parallelism.strategy=usp.* got 2 with 'ring'"):
        recipe_from_dict(base, ["parallelism.ulysses_size=2"])
    usp = recipe_from_dict(base, ["parallelism.strategy=usp", "parallelism.ulysses_size=2"])
    assert usp.parallelism.ulysses_size == 2
    with pytest.raises(ValueError, match="--ulysses-size goes with --strategy usp"):
        PlanRequest(model="SmolLM2-135M-Instruct", seq_len=4096, strategy="ulysses", ulysses_size=2)


def test_eval_cli_needs_ulysses_size_with_usp():
    import argparse

    from longdoc.eval.cli import config

    with pytest.raises(ValueError, match="--strategy usp needs --ulysses-size U"):
        config(argparse.Namespace(dtype="float32", cp=4, strategy="usp", ulysses_size=None))
    with pytest.raises(ValueError, match="--ulysses-size must divide --cp 4, got 3"):
        config(argparse.Namespace(dtype="float32", cp=4, strategy="usp", ulysses_size=3))
    assert config(argparse.Namespace(dtype="float32", cp=4, strategy="usp", ulysses_size=2))["ulysses_size"] == 2
