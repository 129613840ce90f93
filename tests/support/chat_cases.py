"""Rank function of the chat training test (tests/dist/test_train_chat.py): `longdoc train` recipes on chat
data, then CPTrainer on prepared chat rows, in one spawn (longdoc.runtime.spawn pickles it by module and name)."""

from __future__ import annotations

import torch

from tests.support.trainer_cases import launcher_env
from tests.support.training import accelerate_env


def chat_cases(rank: int, world_size: int, recipes: dict[str, dict], overrides: list[str], rows: list[dict],
               out: str) -> dict:
    """Per recipe: the (step, loss, tokens, grad_norm, val_loss) history; "cptrainer": CPTrainer at
    cp=world_size on `rows` (packed chat rows): its logged (step, loss, grad_norm) and the final weights."""
    accelerate_env(rank, world_size)
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    # Accelerator.end_training destroys the process group; the next run needs it (run_ranks tears it down)
    PartialState.destroy_process_group = lambda self, group=None: None
    result = {}
    for name, recipe in recipes.items():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        hist = train(recipe_from_dict(recipe, overrides)).history
        result[name] = [(s.step, s.loss, s.tokens, s.grad_norm, s.val_loss) for s in hist]
    AcceleratorState._reset_state()
    GradientState._reset_state()
    result["cptrainer"] = _cptrainer(rank, world_size, rows, out)
    return result


def _cptrainer(rank: int, world_size: int, rows: list[dict], out: str) -> dict:
    from transformers import TrainingArguments

    from longdoc.corpus.chat import collate
    from longdoc.hf.trainer import CPTrainer
    from longdoc.models import tiny_model

    launcher_env(rank, world_size)
    model = tiny_model("llama", dtype=torch.float64, vocab_size=49152)
    args = TrainingArguments(output_dir=out, max_steps=3, learning_rate=1e-3, warmup_steps=1, adam_epsilon=1e-6,
                             logging_steps=1, report_to="none", use_cpu=True, seed=0, per_device_train_batch_size=2,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             remove_unused_columns=False)
    trainer = CPTrainer(model=model, args=args, data_collator=lambda f: collate(f, pad_id=2), train_dataset=rows,
                        cp_size=world_size)
    trainer.train()
    logs = [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    # numpy copies: tensors would go back through shared memory of a process that has exited
    return {"logs": logs, "weights": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}}
