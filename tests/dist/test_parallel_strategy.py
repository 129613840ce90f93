"""A CP strategy is one object: a toy one defined here, and registered from here only, runs through
`longdoc.attention` (outputs and gradients equal to the float64 single-process reference at world size 2), the
traffic model and the planner, which costs it beside the built-in ones. Plus the registry's own rules."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.parallel import strategies as builtin
from longdoc.parallel import strategy as registry
from longdoc.parallel.api import check_strategy
from longdoc.parallel.strategy import LayerComm, Strategy, Traffic
from longdoc.parallel.traffic import bytes_sent
from longdoc.plan import strategies
from longdoc.plan.planner import PlanRequest, plan
from tests.support.cp_reference import cases, check_cases, run_case
from tests.support.distributed import run_ranks

BUILT_IN = ("ring", "allgather", "ulysses", "usp")


class GatherKV(Strategy):
    """Every rank gathers the full K/V (cp.gather: its backward reduce-scatters dK/dV) and runs SDPA for its own
    queries with a mask from their global positions. Plain causal or bidirectional attention only."""

    name = "toy_gather"

    def attend(self, q, k, v, cp, causal, scale, kernel, **extra):
        k_full, v_full = cp.gather(k, dim=2), cp.gather(v, dim=2)  # (batch, kv_heads, seq_len, head_dim)
        seq_len = k_full.shape[2]
        mask = None
        if causal:
            mask = cp.positions(seq_len, q.device)[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale, enable_gqa=True)

    def bytes_sent(self, *, cp_size, local_len, q_heads, kv_heads, head_dim, itemsize, batch, ulysses_size, rank,
                   ring_steps, backend):
        block = (cp_size - 1) * 2 * batch * kv_heads * local_len * head_dim * itemsize
        return Traffic(block, block)

    def layer_cost(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c, t_fwd, t_bwd, bw_span, lat):
        block = (cp - 1) * 2.0 * tokens * kv_heads * head_dim * c
        wire = block / bw_span(cp) + (cp - 1) * lat
        return LayerComm(t_fwd + wire, t_bwd + wire, block, block)

    def buffers(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c):
        full = 2 * cp * tokens * kv_heads * head_dim * c
        return 2 * full, f"2*2*cp*N*kv*c = 2*2*{cp}*{tokens:,}*{kv_heads * head_dim}*{c}"


TOY = GatherKV()


@pytest.fixture
def toy(monkeypatch):
    """The toy registered for one test; the registry is as before afterwards."""
    registry.names()  # the built-in strategies loaded first
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(TOY)
    return TOY


def test_built_in_strategies_and_refusals():
    assert registry.names() == BUILT_IN
    with pytest.raises(ValueError, match=re.escape("strategy must be one of 'ring', 'allgather', 'ulysses', 'usp', "
                                                   "got 'p2p'")):
        registry.get("p2p")
    with pytest.raises(ValueError, match="'ring' is already registered"):
        registry.register(registry.get("ring"))
    assert [registry.get(n).heads_split(8, 2) for n in BUILT_IN] == [1, 1, 8, 2]
    assert [n for n in BUILT_IN if registry.get(n).factored] == ["usp"]


def test_a_registered_strategy_is_listed_last_and_refused_nowhere(toy):
    assert registry.names() == (*BUILT_IN, "toy_gather") and registry.get("toy_gather") is toy
    assert check_strategy("toy_gather", longdoc.ContextParallel()) == "toy_gather"
    sent = bytes_sent("toy_gather", cp_size=4, seq_len=64, q_heads=4, kv_heads=2, head_dim=8, itemsize=2)
    assert sent == Traffic(3 * 2 * 2 * 16 * 8 * 2, 3 * 2 * 2 * 16 * 8 * 2)


def test_a_new_module_in_the_strategies_folder_is_all_it_takes(tmp_path, monkeypatch):
    (tmp_path / "toy_file.py").write_text(
        "from longdoc.parallel.strategies.ring import Ring\nfrom longdoc.parallel.strategy import register\n\n\n"
        "class ToyFile(Ring):\n    name = 'toy_file'\n    order = 10\n\n\nregister(ToyFile())\n")
    registry.names()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(builtin, "__path__", [*builtin.__path__, str(tmp_path)])
    try:
        assert registry.names() == (*BUILT_IN, "toy_file")
    finally:
        sys.modules.pop(f"{builtin.__name__}.toy_file", None)


def test_the_planner_costs_a_registered_strategy(toy):
    req = dict(model="SmolLM2-135M", seq_len=1 << 14, gpus=2, gpu="cpu", memory_gib=64.0, cp=2)
    pinned = plan(PlanRequest(**req, strategy="toy_gather"))
    assert pinned.candidates and {c.setup.strategy for c in pinned.candidates} == {"toy_gather"}
    best = pinned.best
    assert best is not None and best.time.total > 0 and best.time.comm_bytes["cp"] > 0
    assert "parallelism.strategy=toy_gather" in best.recipe_keys()
    n, shape = best.setup.tokens, best.setup.shape
    kv = shape.kv_heads * shape.head_dim
    got = strategies.buffers("toy_gather", cp=2, ulysses=None, tokens=n, q_heads=shape.heads,
                             kv_heads=shape.kv_heads, head_dim=shape.head_dim, c=4)
    assert got[0] == 2 * 2 * 2 * n * kv * 4
    every = plan(PlanRequest(**req))
    assert {c.setup.strategy for c in every.candidates} >= {*BUILT_IN, "toy_gather"} - {"usp"}  # usp: no 1 < U < 2


def test_a_recipe_takes_a_registered_strategy(toy):
    from longdoc.train.config import recipe_from_dict

    recipe = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.strategy=toy_gather"])
    assert recipe.parallelism.strategy == "toy_gather"


def _toy_cases(rank: int, world_size: int) -> list[tuple[tuple, dict[str, float]]]:
    registry.register(TOY)  # a fresh process: only the built-in strategies are registered
    results = []
    for i, case in enumerate(cases(head_dims=(16,), strategies=("toy_gather",))):
        cp = longdoc.ContextParallel(layout=case[0], timeout=60)
        results.append((case, run_case(cp, case, seed=7000 + i)))
    return results


def test_a_registered_strategy_is_exact_at_world_size_2():
    results = run_ranks(2, _toy_cases)
    assert len(results[0]) == len(cases(head_dims=(16,), strategies=("toy_gather",)))
    for rank_results in results:
        check_cases(rank_results, 2)
