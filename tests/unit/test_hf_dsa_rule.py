"""The DSA indexer's stable rule (longdoc.hf.kinds.dsa) in one process on CPU: the selection is the same at every
tile shape and for the pieces of 2 and 3 ranks, crafted exact ties included, and it is the rule's by definition
(highest float64 score, equal scores to the lower key index). tests/dist/test_hf_dsa_gpu.py runs the same on CUDA."""

from __future__ import annotations

import pytest
import torch

from longdoc.hf.kinds import dsa
from tests.support.dsa_rule import by_rule, exact_ties, indexer_case, row_scores, select, select_as_ranks


@pytest.mark.parametrize("seed", [0, 1])
def test_stable_selection_is_the_same_at_every_tile_shape_and_rank_count(seed):
    case = indexer_case("cpu", seed)
    full = select(case)
    scores = row_scores(case)
    assert exact_ties(scores) >= 10, "the crafted zero keys must tie at the k-th place"
    assert torch.equal(full.cpu(), by_rule(scores))
    for rows in (1, 2, 3, 7):
        assert torch.equal(select(case, rows), full), rows
    for world in (2, 3):
        for layout in ("zigzag", "contiguous"):
            for rows in (None, 2):
                assert torch.equal(select_as_ranks(case, world, layout, rows), full), (world, layout, rows)


def test_the_rule_follows_the_device():
    assert not dsa.stable_rule(torch.device("cpu")) and dsa.stable_rule(torch.device("cuda"))
    x = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0, 0.0]]])
    assert dsa.stable_topk(x, 4).indices.tolist() == [[[1, 2, 4, 0]]]
