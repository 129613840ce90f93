"""`longdoc train` with parallelism.strategy=ulysses (cp=2) and usp 2 x 2 (cp=4, recipe key ulysses_size) equals
single-process training: the same logged losses, token counts and gradient norms on every rank, and the same
final weights."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.support.training import max_rel_err, ranks, tiny_recipe, train_on_ranks

RUNS = {
    "ulysses-cp2": (2, ["parallelism.cp_size=2", "parallelism.strategy=ulysses"]),
    "usp2x2-cp4": (4, ["parallelism.cp_size=4", "parallelism.strategy=usp", "parallelism.ulysses_size=2"]),
}


def test_ulysses_and_usp_training_equal_single_process(tmp_path):
    ref, _ = ranks(1, train_on_ranks, tiny_recipe(tmp_path / "single"), [], deadline=300)[0]
    w_ref = load_file(tmp_path / "single" / "final" / "model.safetensors")
    errs = {}
    for name, (world, overrides) in RUNS.items():
        for hist, _ in ranks(world, train_on_ranks, tiny_recipe(tmp_path / name), overrides, deadline=600):
            for (s, loss, tok, gn), (s0, loss0, tok0, gn0) in zip(hist, ref, strict=True):
                assert (s, tok) == (s0, tok0), name
                assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6), name
                assert gn == pytest.approx(gn0, rel=1e-5), name
        errs[name] = max_rel_err(load_file(tmp_path / name / "final" / "model.safetensors"), w_ref)
    assert all(e <= 1e-5 for e in errs.values()), errs
