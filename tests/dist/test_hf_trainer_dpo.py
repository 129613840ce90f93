"""TRL DPOTrainer with CPDPOTrainerMixin at cp=2 logs and trains what plain DPOTrainer does in one process.

One spawn per world size (2 ranks: cp=2, every case inside it; 4 ranks: dp=2 x cp=2, one case), ~25 s each.
Float64 tiny Llama: CP changes only the summation order of attention (its softmax blocks merge in fp32), so
relative 1e-5 is far above that and far below a real mismatch. SGD, so the final parameters compare like the
gradients. Rewards are differences of nearly equal log-probs (exactly 0 at step 1, where policy = reference), so
they are held to the log-probs' scale: |diff| <= 1e-5 * (1 + beta * |logps|).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.dpo_trainer_cases import run_dpo
from tests.support.trainer_cases import launcher_env

REL = 1e-5
BETA = 0.1

CASES = {
    # LoRA: the reference is the adapter-disabled policy; sigmoid loss, 2 micro-batches per step, gradient
    # checkpointing (the layers recomputed in backward run CP attention again; TRL turns it off for the reference)
    "lora-sigmoid": {"batch": 2, "accum": 2, "checkpointing": True},
    # full fine-tuning against a separate reference model (patched too); IPO and WPO-free ld_alpha use per-token
    # masks and completion lengths, and sft uses the chosen tokens' mean
    "ref-model-ipo-sft-ld": {"batch": 2, "accum": 1, "lora": False, "loss_type": ["ipo", "sft"], "ld_alpha": 0.5,
                             "lr": 1e-3},
    # reference log-probs precomputed (through the CP hooks, after CP joined), full fine-tuning
    "precompute": {"batch": 2, "accum": 1, "lora": False, "precompute": True, "lr": 1e-3},
}


def _cases_on_ranks(rank: int, world_size: int, cases: dict, out: str) -> dict:
    """Every case on this rank at cp=2 (dp = world_size / 2)."""
    launcher_env(rank, world_size)
    return {name: run_dpo(case, f"{out}/{name}", cp_size=2) for name, case in cases.items()}


def _close(key: str, a, b, scale: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    tol = REL * (1 + BETA * scale) if key.startswith("rewards/") else REL * max(abs(b), 1e-30)
    return abs(a - b) <= tol


def _errors(name: str, rank: int, got: dict, ref: dict, dp: int = 1) -> list[str]:
    """Every logged value and parameter; at dp > 1 the training steps only (TRL averages eval metrics per batch, and
    the replicas batch the eval rows differently from one process)."""
    errors = []
    pairs = [*zip(got["logs"], ref["logs"], strict=True)] + ([(got["eval"], ref["eval"])] if dp == 1 else [])
    for step, (mine, theirs) in enumerate(pairs, start=1):
        scale = max(abs(theirs["logps/chosen"] or 0), abs(theirs["logps/rejected"] or 0))
        bad = {k: (mine[k], theirs[k]) for k in theirs if not _close(k, mine[k], theirs[k], scale)}
        if bad:
            errors.append(f"{name} rank {rank} {'eval' if step > len(ref['logs']) else f'step {step}'}: {bad}")
    if got["ref_patched"] is False:
        errors.append(f"{name} rank {rank}: the reference model was not patched for CP")
    for p, want in ref["params"].items():
        if not torch.allclose(got["params"][p], want, rtol=REL, atol=1e-9):
            errors.append(f"{name} rank {rank}: parameter {p} differs by {(got['params'][p] - want).abs().max()}")
    return errors


def check_cases(tmp_path, cases: dict, dp: int = 1) -> None:
    """Run `cases` at dp x cp=2 (one spawn) and as plain DPOTrainer here; assert every logged value and parameter."""
    results = run_ranks(2 * dp, _cases_on_ranks, cases, str(tmp_path / "cp2"), deadline=300, pg_timeout=200)
    errors = []
    for name, case in cases.items():
        ref = run_dpo(case, str(tmp_path / f"ref-{name}"), cp_size=None, dp=dp)
        assert len(ref["logs"]) == 2 and all(v is not None for v in ref["logs"][0].values()), ref["logs"]
        for rank, res in enumerate(results):
            errors += _errors(name, rank, res[name], ref, dp)
    assert not errors, "\n".join(errors)


def test_cp2_dpo_equals_single_process(tmp_path):
    check_cases(tmp_path, CASES)


@pytest.mark.slow  # the fast tier: test_cp2_dpo_equals_single_process (issue 39's acceptance: cp=2 in make test)
def test_dp2_cp2_dpo_equals_single_process(tmp_path):
    # 2 replicas x cp=2: DDP averages over all 4 ranks, TRL gathers its metrics over all 4 (each replica's twice)
    check_cases(tmp_path, {"lora-sigmoid-dp2": {"batch": 2, "accum": 1}}, dp=2)
