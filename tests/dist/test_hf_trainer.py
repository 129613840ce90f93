"""CPTrainer and the TRL SFTTrainer mixin log what one process logs (issue 14 acceptance).

One spawn per world size (2 ranks: cp=2; 4 ranks: dp=2 x cp=2); every case runs inside it. The references
are plain transformers.Trainer / trl.SFTTrainer in this process, with the same global batch (per-device
batch sizes times dp). Documents have different lengths, so right padding and the uneven last eval batch
are exercised; float64 tiny models, so 1e-5 is far above rounding and far below any real mismatch.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.trainer_cases import launcher_env, run_trainer

REL = 1e-5

CP2_CASES = {
    "trainer-accum2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2},
    "trainer-per-replica-tokens": {"kind": "trainer", "batch": 2, "accum": 1, "eval_batch": 2,
                                   "average_tokens": False},
    "sft-completion-only": {"kind": "sft", "batch": 1, "accum": 2, "eval_batch": 2},
}
DP2CP2_CASES = {
    # eval batch 1: Trainer's eval_loss averages batch means, so only equal batches compare exactly; 5 rows
    # over 2 replicas still leaves the last round padded by Accelerate, which must be dropped.
    "trainer-dp2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 1},
    "sft-dp2": {"kind": "sft", "batch": 1, "accum": 1, "eval_batch": 1},
}


def _cases_on_ranks(rank: int, world_size: int, cases: dict, out: str) -> dict:
    launcher_env(rank, world_size)
    return {name: run_trainer(case, f"{out}/{name}", cp_size=2) for name, case in cases.items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _check(results: list[dict], cases: dict, dp: int, tmp_path) -> None:
    errors = []
    for name, case in cases.items():
        ref = run_trainer(case, str(tmp_path / f"ref-{name}"), cp_size=None, dp=dp)
        assert len(ref["logs"]) == 3
        for rank, res in enumerate(results):
            got = res[name]
            assert [s for s, _, _ in got["logs"]] == [1, 2, 3], (name, got["logs"])
            for (step, loss, gn), (_, rloss, rgn) in zip(got["logs"], ref["logs"], strict=True):
                if _rel(loss, rloss) > REL or _rel(gn, rgn) > REL:
                    errors.append(f"{name} rank {rank} step {step}: loss {loss} vs {rloss}, grad_norm {gn} vs {rgn}")
            if _rel(got["eval_loss"], ref["eval_loss"]) > REL:
                errors.append(f"{name} rank {rank}: eval_loss {got['eval_loss']} vs {ref['eval_loss']}")
    assert not errors, "\n".join(errors)


def test_cp2_trainer_and_sft_equal_single_process(tmp_path):
    results = run_ranks(2, _cases_on_ranks, CP2_CASES, str(tmp_path / "cp2"), deadline=400, pg_timeout=300)
    _check(results, CP2_CASES, 1, tmp_path)


def test_dp2_cp2_trainer_and_sft_equal_single_process(tmp_path):
    results = run_ranks(4, _cases_on_ranks, DP2CP2_CASES, str(tmp_path / "dp2cp2"), deadline=500, pg_timeout=300)
    _check(results, DP2CP2_CASES, 2, tmp_path)


def _resume_on_ranks(rank: int, world_size: int, out: str) -> tuple[dict, dict]:
    launcher_env(rank, world_size)
    case = {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "lora": True, "checkpointing": True,
            "save": True}
    whole = run_trainer(case, f"{out}/whole", cp_size=2)
    # The same run, resumed from its step-2 checkpoint: step 3 must be the uninterrupted run's step 3.
    import shutil

    if rank == 0:
        shutil.rmtree(f"{out}/whole/checkpoint-3")
    import torch.distributed as dist

    dist.barrier()
    resumed = run_trainer(case, f"{out}/whole", cp_size=2, resume=True)
    return whole, resumed


@pytest.mark.slow
def test_cp2_lora_checkpointing_save_and_resume(tmp_path):
    ref = run_trainer({"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "lora": True,
                       "checkpointing": True}, str(tmp_path / "ref"), cp_size=None)
    for whole, resumed in run_ranks(2, _resume_on_ranks, str(tmp_path), deadline=500, pg_timeout=300):
        for (step, loss, gn), (_, rloss, rgn) in zip(whole["logs"], ref["logs"], strict=True):
            assert _rel(loss, rloss) < REL and _rel(gn, rgn) < REL, (step, loss, rloss, gn, rgn)
        # the resumed log history holds steps 1-2 from the checkpoint's trainer_state.json, then the new step 3
        assert [s for s, _, _ in resumed["logs"]] == [1, 2, 3] and resumed["logs"][:2] == whole["logs"][:2]
        step, loss, gn = resumed["logs"][2]
        assert _rel(loss, whole["logs"][2][1]) < REL and _rel(gn, whole["logs"][2][2]) < REL
        assert _rel(whole["eval_loss"], ref["eval_loss"]) < REL
