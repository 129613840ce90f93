"""Hybrid models (Mamba1/2, short convolutions beside attention) patched under CP against one process:
loss, logits and every gradient, plain / padded / packed rows, both layouts and strategies, activation
checkpointing, attention under ulysses (CP 2) and usp (CP 4: 2 x 2); CP sizes above the Mamba group count
(n_groups=1, and 2 in the VARIANTS). One spawn per world size.

Default suite: the acceptance families at CP 2 and 3 (every case); the rest of tests/hf_hybrids.py at CP 2
(packed rows). Slow: every family, every case, at CP 2, 3 and 4, and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf_hybrids import HYBRIDS, VARIANTS, hybrid_pair
from tests.hybrid_cases import CASES, ULYSSES, USP, batch_of, compare, reference

CORE = ("granitemoehybrid", "nemotron_h", "falcon_h1", "jamba", "mamba2", "lfm2")
TOL = {torch.float32: dict(loss=1e-5, logits=1e-4, grads=1e-4),
       torch.bfloat16: dict(loss=2e-2, logits=5e-2, grads=1e-1)}


def _rank(rank, world, plan):
    import longdoc

    out = {}
    for arch, cases, dtype in plan:
        ref, model = hybrid_pair(arch, dtype=dtype)
        for case in cases:
            if case.checkpointing:
                model.gradient_checkpointing_enable()
                model.train()
            batch, docs = batch_of(case)
            cp = longdoc.ContextParallel(layout=case.layout, timeout=120, ulysses_size=case.ulysses_size)
            longdoc.patch(model, cp, strategy=case.strategy)
            out[(arch, case.name, str(dtype))] = compare(model, cp, batch, docs, reference(ref, batch, docs))
    return out


def _check(per_rank):
    bad = []
    for res in per_rank:
        for (arch, case, dtype), errs in res.items():
            tol = TOL[getattr(torch, dtype.removeprefix("torch."))]
            if any(errs[k] > tol[k] for k in tol):
                bad.append(f"{arch} {case} {dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert not bad, "CP differs from one process:\n" + "\n".join(sorted(set(bad)))


def _plan(archs, cases, dtype=torch.float32):
    return [(a, tuple(cases), dtype) for a in archs]


@pytest.mark.parametrize("world", [2, 3])
def test_core_hybrids(world):
    plan = _plan(CORE, CASES) + _plan(VARIANTS, (CASES[0], CASES[2]))
    if world == 2:
        plan += _plan([a for a in HYBRIDS if a not in CORE], [CASES[2]]) + _plan(CORE, ULYSSES)
    _check(run_ranks(world, _rank, plan, deadline=1200))


def test_core_hybrids_usp_cp4():  # 22 s
    _check(run_ranks(4, _rank, _plan(CORE, USP), deadline=1200))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_hybrid_every_case(world):
    plan = _plan([*HYBRIDS, *VARIANTS], CASES) + _plan(["granitemoehybrid", "jamba", "lfm2"], CASES[:1], torch.bfloat16)
    _check(run_ranks(world, _rank, plan, deadline=3000))
