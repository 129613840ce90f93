"""TRL DPOTrainer runs for the CP DPO tests: tiny preference rows in TRL's text format, a tiny float64 Llama, and
one function that trains a (CP or plain) DPOTrainer and returns what it logged and its final parameters."""

from __future__ import annotations

import torch

from tests.support.trainer_cases import VOCAB, word_tokenizer

# The metrics TRL's DPOTrainer logs per step, which CP must reproduce
DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
               "num_tokens")
PROMPTS = [29, 41, 23, 36, 33, 27, 45, 31]  # prompt tokens per row; chosen and rejected lengths differ per row


def preference_rows(seed: int, n: int = 8) -> list[dict]:
    """{"prompt", "chosen", "rejected"} text rows over the words <3>..<255> (word_tokenizer: one token a word)."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(f"<{i}>" for i in torch.randint(3, VOCAB, (k,), generator=g).tolist())

    return [{"prompt": words(PROMPTS[i % len(PROMPTS)]), "chosen": " " + words(5 + (3 * i) % 11),
             "rejected": " " + words(4 + (5 * i) % 13)} for i in range(n)]


def _on_disk(dataset, path: str):
    """The dataset saved by rank 0 and read back by every rank: TRL caches precomputed reference log-probs next to
    the dataset's files, which an in-memory dataset has in a temporary folder of each process's own."""
    import torch.distributed as dist
    from datasets import load_from_disk

    if not dist.is_initialized() or dist.get_rank() == 0:
        dataset.save_to_disk(path)
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(path)


def run_dpo(case: dict, out: str, cp_size: int | None, dp: int = 1) -> dict:
    """Train `case` for 2 steps (then evaluate); cp_size None: plain trl.DPOTrainer in this process, its train batch
    times dp so that the global batch matches."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import DPOConfig, DPOTrainer

    from longdoc.hf import is_patched
    from longdoc.hf.dpo_trainer import CPDPOTrainerMixin
    from longdoc.models import tiny_model

    model = tiny_model("llama", dtype=torch.float64, vocab_size=VOCAB)
    ref_model = None
    if case.get("lora", True):
        torch.manual_seed(0)  # LoRA's A matrices from the global RNG: the same in the reference and every rank
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    elif not case.get("precompute"):
        ref_model = tiny_model("llama", dtype=torch.float64, vocab_size=VOCAB)  # the same seed: a copy
    args = DPOConfig(output_dir=out, max_steps=2, learning_rate=case.get("lr", 1e-2), lr_scheduler_type="constant",
                     optim="sgd",  # the step is lr x gradient: parameters compare like gradients (Adam divides by
                     # sqrt(v) + eps, which turns a 1e-12 gradient difference on a ~eps gradient into a visible one)
                     per_device_train_batch_size=case["batch"] * (dp if cp_size is None else 1),
                     gradient_accumulation_steps=case["accum"],
                     per_device_eval_batch_size=2, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                     bf16=False, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, max_length=None,
                     beta=0.1, loss_type=case.get("loss_type", ["sigmoid"]), ld_alpha=case.get("ld_alpha"),
                     precompute_ref_log_probs=case.get("precompute", False),
                     gradient_checkpointing=case.get("checkpointing", False))
    train, evals = Dataset.from_list(preference_rows(0)), Dataset.from_list(preference_rows(1, 4))
    if case.get("precompute"):
        train, evals = _on_disk(train, f"{out}/train"), _on_disk(evals, f"{out}/eval")
    extra = {} if cp_size is None else {"cp_size": cp_size}
    base = DPOTrainer if cp_size is None else type("CPDPOTrainer", (CPDPOTrainerMixin, DPOTrainer), {})
    trainer = base(model=model, ref_model=ref_model, args=args, processing_class=word_tokenizer(),
                   train_dataset=train, eval_dataset=evals, **extra)
    trainer.train()
    logs = [{k: h.get(k) for k in DPO_METRICS} for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    # the separate reference model runs under CP too (not merely unsharded, which would also give the right values)
    ref_patched = None if trainer.ref_model is None else is_patched(trainer.ref_model)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"logs": logs, "eval": {k: metrics.get(f"eval_{k}") for k in DPO_METRICS if k != "grad_norm"},
            "params": params, "ref_patched": ref_patched}
