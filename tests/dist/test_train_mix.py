"""Training mixes under CP and DP: every loss term a mix adds (document-token loss weights on QA rows, a
per-source loss weight, KL toward the frozen base on the documents, packed replay text) takes the same step
at cp=2 and at dp=2 as in one process, also with the document loss and KL at drawn context positions
(context_positions: drawn on the full row before sharding); and a mix resumes exactly.

Steps after the first are compared at identical parameters: the CP and DP runs are pinned to the one-process run's
parameters after each step (tests/support/training.py: train_pinned), so their step-k gradients differ from one
process's only by what step k computes, with Adam's default-sized eps (tiny_recipe: 1e-6)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.support.mix_data import mix_recipe, train_stopped_at, write_mix_inputs
from tests.support.training import max_rel_err, ranks, train_on_ranks, train_pinned


def _compare(ref, runs, label, ref_grads):
    for rank_hist, rank_grads, _ in runs:
        # the reduced gradients the optimizer applied, every step, relative to each tensor's largest element
        for step, (step_grads, step_ref) in enumerate(zip(rank_grads, ref_grads, strict=True), 1):
            errs = [float(abs(g - r).max() / max(abs(r).max(), 1e-30)) for g, r in zip(step_grads, step_ref,
                                                                                     strict=True)]
            worst = max(range(len(errs)), key=errs.__getitem__)
            assert errs[worst] <= 1e-5, (label, f"step {step}", f"tensor {worst} of {len(errs)}",
                                         tuple(step_ref[worst].shape), errs[worst], float(abs(step_ref[worst]).max()))
        assert len(rank_hist) == len(ref) == 3
        for (s, loss, tok, gn), (s0, loss0, tok0, gn0) in zip(rank_hist, ref, strict=True):
            assert (s, tok) == (s0, tok0), label
            assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6), (label, s, loss, loss0)
            assert gn == pytest.approx(gn0, rel=1e-5), (label, s, gn, gn0)


def _equal_to_one_process(tmp_path, paths, layouts: dict[str, list[str]], **kw) -> list:
    """Each layout's run (name -> overrides) takes the one-process run's steps and ends at its weights; returns
    the one-process history."""
    ref, ref_grads, pin = ranks(1, train_pinned, mix_recipe(paths, tmp_path / "one", **kw), [], deadline=400)[0]
    for name, overrides in layouts.items():
        run = ranks(2, train_pinned, mix_recipe(paths, tmp_path / name, **kw), overrides, pin, deadline=400)
        _compare(ref, run, name, ref_grads)
    w_ref = load_file(tmp_path / "one" / "final" / "model.safetensors")
    for name in layouts:
        w = load_file(tmp_path / name / "final" / "model.safetensors")
        errs = {k: max_rel_err({k: w[k]}, {k: w_ref[k]}) for k in w_ref}
        print(name, sorted(errs.items(), key=lambda kv: -kv[1])[:3])
        # the tied embedding / lm_head matrix: Adam turns the ~1e-9 gradients of tokens the rows never contain
        # into full +-lr steps whose sign follows float rounding, so its rows are compared looser (the reduced
        # gradients above are compared at 1e-5)
        assert max(e for k, e in errs.items() if "embed_tokens" not in k) <= 1e-5, (name, errs)
        assert errs["model.embed_tokens.weight"] <= 1e-3, (name, errs)
    return ref


def test_mix_cp2_and_dp2_equal_single_process(tmp_path):
    paths = write_mix_inputs(tmp_path / "data")
    ref = _equal_to_one_process(tmp_path, paths, {"cp2": ["parallelism.cp_size=2"], "dp2": []})
    # the KL term is in those losses: without it the same run logs another loss once the adapters moved
    no_kl, _ = ranks(1, train_on_ranks, mix_recipe(paths, tmp_path / "nokl", kl=0.0), [], deadline=400)[0]
    assert no_kl[0][1] == pytest.approx(ref[0][1], rel=1e-6)  # step 1: tuned == base, KL is 0
    assert abs(no_kl[2][1] - ref[2][1]) > 1e-4, (no_kl, ref)


def test_mix_context_positions_cp2_equals_single_process(tmp_path):
    """context_positions=8 on the QA source (document loss and KL) and the packed text source (KL): every CP rank
    draws the same positions from the full row, so cp=2 takes the one-process steps, sampling included."""
    paths = write_mix_inputs(tmp_path / "data")
    ref = _equal_to_one_process(tmp_path, paths, {"cp2": ["parallelism.cp_size=2"]}, context_positions=8)
    # the draw is in those steps: every context token gives another loss from step 1 on (where the KL is still 0)
    every, _ = ranks(1, train_on_ranks, mix_recipe(paths, tmp_path / "every"), [], deadline=400)[0]
    assert abs(every[0][1] - ref[0][1]) > 1e-3, (every, ref)


@pytest.mark.slow  # a whole run twice; the fast tier resumes exactly in test_train_resume (cp=1, 2 and a cp change)
def test_mix_resumes_exactly(tmp_path):
    """Stopped after step 2's checkpoint, resumed: step 3 and the exported model are those of an uninterrupted
    run (the mix order, the token weights and the trained embedding / norm copies all come back)."""
    paths = write_mix_inputs(tmp_path / "data")
    full, _ = ranks(1, train_on_ranks, mix_recipe(paths, tmp_path / "full"), [], deadline=400)[0]
    cut = mix_recipe(paths, tmp_path / "cut")
    assert ranks(1, train_stopped_at, cut, ["checkpoint.every=1"], 3, deadline=400)[0] == [1, 2]
    rest, _ = ranks(1, train_on_ranks, cut, ["checkpoint.every=1", "resume=true"], deadline=400)[0]
    assert [s for s, *_ in rest] == [3]
    assert rest[0][1] == pytest.approx(full[2][1], rel=1e-6) and rest[0][3] == pytest.approx(full[2][3], rel=1e-6)
    err = max_rel_err(load_file(tmp_path / "cut" / "final" / "model.safetensors"),
                      load_file(tmp_path / "full" / "final" / "model.safetensors"))
    assert err <= 1e-6, err
