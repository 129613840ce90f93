"""Shared pieces of the CPTrainer tests: tiny data of different lengths, a collator, a word-level tokenizer,
and one function that runs a (CP or plain) Trainer and returns what it logged."""

from __future__ import annotations

import os

import numpy as np
import torch

VOCAB = 256
TRAIN_LENGTHS = [37, 50, 23, 64, 41, 30, 55, 45, 33, 60, 28, 47, 39, 52, 26, 58]
EVAL_LENGTHS = [31, 44, 27, 53, 36]


def rows(lengths: list[int], seed: int, answer_only: bool = False) -> list[dict]:
    """answer_only: loss on the last sixth of each row only (under zigzag cp=2, CP rank 1 then has none)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        labels = list(ids)
        prompt = n - n // 6 if answer_only else n // 3
        labels[:prompt] = [-100] * prompt  # a prompt without loss, like QA rows
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(features: list[dict]) -> dict:
    """Right padding: pad id 0, labels -100, attention_mask 0."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    labels = torch.full((len(features), n), -100, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        ids[i, :k] = torch.tensor(f["input_ids"])
        labels[i, :k] = torch.tensor(f["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def word_tokenizer():
    """A tokenizer over the words <0>..<255> (id = number): real text in, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # <i> rather than ti: special tokens match inside words, and "t1" would split "t123"
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB)}, unk_token="<2>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<0>", eos_token="<1>", unk_token="<2>")


def sft_rows(lengths: list[int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        cut = n // 2
        out.append({"prompt": " ".join(f"<{i}>" for i in ids[:cut]),
                    "completion": " " + " ".join(f"<{i}>" for i in ids[cut:])})
    return out


def argmax_logits(logits, labels):
    return logits.argmax(-1)


def token_accuracy(pred) -> dict:
    """Next-token accuracy from gathered argmax predictions: needs the FULL sequence's logits in order."""
    guess, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
    keep = labels != -100
    # accuracy of a random model is ~0 either way; the checksum pins every prediction and its position
    where = guess.astype("int64") * keep * (1 + np.arange(guess.shape[1]))
    return {"accuracy": float((guess == labels)[keep].mean()), "scored": int(keep.sum()), "checksum": int(where.sum())}


def launcher_env(rank: int, world_size: int) -> None:
    # run_ranks has already joined the gloo group; Trainer's PartialState reads the launcher's variables.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                      LONGDOC_DEBUG_COLLECTIVES="1")  # every collective CPTrainer issues is checked


def run_trainer(case: dict, out: str, cp_size: int | None, dp: int = 1, resume: bool = False) -> dict:
    """Train `case` for 3 steps, then evaluate; return the logged (step, loss, grad_norm) and eval_loss.

    cp_size None: the plain transformers / TRL trainer, train batch sizes times dp so the global batch matches
    (eval batches stay equal: eval_loss averages batch means)."""
    from transformers import Trainer, TrainingArguments

    from longdoc.hf.trainer import CPTrainerMixin
    from longdoc.models import tiny_model

    scale = dp if cp_size is None else 1
    common = dict(output_dir=out, max_steps=3, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1,
                  adam_epsilon=1e-6, weight_decay=0.01, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                  per_device_train_batch_size=case["batch"] * scale,
                  gradient_accumulation_steps=case["accum"],
                  per_device_eval_batch_size=case["eval_batch"],  # eval_loss averages batch means
                  average_tokens_across_devices=case.get("average_tokens", True),
                  save_strategy="steps" if case.get("save") else "no", save_steps=2,
                  disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    # "vocab": the model's vocabulary (the rows' ids stay below VOCAB): 49,152 puts lm_head in a DDP bucket of its own
    model = tiny_model("llama", dtype=torch.float64, vocab_size=case.get("vocab", VOCAB))
    if case.get("model") == "mixtral":  # eager experts: the default grouped_mm has no float64
        model = tiny_model("mixtral", dtype=torch.float64, vocab_size=VOCAB, output_router_logits=True,
                           router_aux_loss_coef=0.3)
        model.set_experts_implementation("eager")
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # LoRA's A matrices come from the global RNG: the same in the reference and every rank
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if case.get("checkpointing"):
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    # case["cp"]: more CPTrainer arguments (cp_strategy, cp_ulysses_size); the reference ignores them
    extra = {} if cp_size is None else {"cp_size": cp_size, **case.get("cp", {})}
    if case["kind"] == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        base = SFTTrainer if cp_size is None else type("CPSFTTrainer", (CPTrainerMixin, SFTTrainer), {})
        packing = dict(packing=True, max_length=128) if case.get("packing") else dict(max_length=None)
        args = SFTConfig(**common, completion_only_loss=True, bf16=False, **packing)  # TRL defaults to bf16
        trainer = base(model=model, args=args, processing_class=word_tokenizer(),
                       train_dataset=Dataset.from_list(sft_rows(TRAIN_LENGTHS, 0)),
                       eval_dataset=Dataset.from_list(sft_rows(EVAL_LENGTHS, 1)), **extra)
    else:
        from longdoc.hf.trainer import CPTrainer

        base = Trainer if cp_size is None else CPTrainer
        if case.get("metrics"):
            extra.update(compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_logits)
        collator = collate
        if case.get("packed") and cp_size is not None:
            # the same batches flattened into one packed row each: exact document masking must give the
            # reference's (right-padded, one document per row) loss, grad_norm and eval_loss
            from transformers import DataCollatorWithFlattening

            collator = DataCollatorWithFlattening()
        answer_only = case.get("answer_only", False)
        trainer = base(model=model, args=TrainingArguments(**common), data_collator=collator,
                       train_dataset=rows(TRAIN_LENGTHS, 0, answer_only),
                       eval_dataset=rows(EVAL_LENGTHS, 1, answer_only), **extra)
    trainer.train(resume_from_checkpoint=resume or None)
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    # TRL's own per-step metrics (None for a plain Trainer) and Trainer's FLOP count
    sft = [tuple(h.get(k) for k in SFT_METRICS) for h in trainer.state.log_history if "loss" in h]
    flos = trainer.state.total_flos
    metrics = trainer.evaluate()
    groups = getattr(trainer, "_cp_groups", None)  # how many collectives the debug guard checked per group
    guard = {k: getattr(groups.guard(k) if k != "cp" else trainer.cp.guard, "seq", 0) for k in ("cp", "grads", "dp")} \
        if groups is not None else None
    return {"logs": logs, "eval_loss": metrics["eval_loss"], "sft": sft, "total_flos": flos, "guard": guard,
            "eval_sft": [metrics.get(f"eval_{k}") for k in SFT_METRICS[:2]],
            "eval_metrics": [metrics.get(f"eval_{k}") for k in ("accuracy", "scored", "checksum")]}


SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")
