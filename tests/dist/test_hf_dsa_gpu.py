"""The DSA indexer's selection on CUDA (longdoc.hf.kinds.dsa's stable rule, the default there): the same at every
tile shape and for the pieces of 2 and 3 ranks, crafted exact ties included; the rule's by definition; and
transformers' own indexer (fp32 GEMM + torch.topk) chooses the same keys wherever its k-th and next scores are
more than 1e-4 apart (the guarantee against transformers stated in docs/concepts.md). Runs only with a GPU."""

from __future__ import annotations

import pytest
import torch

from longdoc.hf.kinds import dsa
from tests.support.dsa_rule import TOPK, by_rule, exact_ties, indexer_case, row_scores, select, select_as_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dsa_selection_on_cuda_is_the_same_at_every_tile_shape(seed):
    case = indexer_case("cuda", seed)
    assert dsa.stable_rule(case.keys.device)
    full = select(case, stable=None)  # the device's rule
    scores = row_scores(case)
    assert exact_ties(scores) >= 10
    assert torch.equal(full.cpu(), by_rule(scores))
    for rows in (1, 2, 3, 7):
        assert torch.equal(select(case, rows, stable=None), full), rows
    for world in (2, 3):
        for layout in ("zigzag", "contiguous"):
            assert torch.equal(select_as_ranks(case, world, layout, 2, stable=None), full), (world, layout)


def test_dsa_selection_on_cuda_agrees_with_transformers_away_from_near_ties():
    case = indexer_case("cuda", 3)
    full = select(case, stable=None).cpu()
    scores = row_scores(case).cpu()
    causal = torch.ones(48, 48, dtype=torch.bool, device="cuda").tril()[None].expand(2, -1, -1)
    module = case.forward.__self__

    class _Keys:
        def update_indexer(self, k, layer_idx):
            return case.keys

    theirs = module(**{**case.call, "attention_mask": causal, "cache": _Keys()}).cpu()
    v = scores.sort(dim=-1, descending=True).values
    gap = (v[..., TOPK - 1] - v[..., TOPK]).abs()
    clear = (gap > 1e-4 * v[..., 0].abs().clamp_min(1e-30)) | ~torch.isfinite(v[..., TOPK])
    assert clear.sum() > 20
    for b, i in clear.nonzero().tolist():  # keys after the query are hidden whichever were picked
        assert {j for j in full[b, i].tolist() if j <= i} == {j for j in theirs[b, i].tolist() if j <= i}, (b, i)
