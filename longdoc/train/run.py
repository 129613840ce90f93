"""What a training run works on, built on every rank: the model, the data and their step schedule, the optimizer
and LR schedule over the world (`build`), then the state of a checkpoint when the run continues one (`resume`).

    run = build(recipe, world, say)
    resume(run, resume_dir, ck_root)      # step, scheduler, skipped steps, early stopping from the checkpoint
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longdoc.train import checkpoint
from longdoc.train.config import Recipe, RecipeError
from longdoc.train.data import StepSchedule, load_sequences
from longdoc.train.dpo_step import ReferenceCache
from longdoc.train.loss import ChunkStats, LossModel, check_head
from longdoc.train.metrics import PeakMemory, Progress
from longdoc.train.mix import MixSchedule, describe, load_mix
from longdoc.train.modeling import build as build_model
from longdoc.train.validation import EarlyStopping, split_held_out
from longdoc.train.world import World


class Say:
    """Rank 0's messages: above the progress bar once there is one (not through it), else printed."""

    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.progress: Progress | None = None

    def __call__(self, msg: str) -> None:
        if not self.is_main:
            return
        if self.progress is not None:
            self.progress.write(msg)
        else:
            print(msg, flush=True)


@dataclass
class Run:
    """Everything one rank's training steps read and advance."""

    recipe: Recipe
    world: World
    say: Callable[[str], None]
    model: Any  # the transformers model (LoRA-wrapped, CP-patched), before Accelerate's wrapping
    tokenizer: Any
    pad_id: int
    seqs: Any  # training rows (train.data.Sequences, or a mix of them)
    held_out: Any  # validation rows, or None
    schedule: StepSchedule | MixSchedule
    stopper: EarlyStopping
    logit_rows: ChunkStats  # the largest logits block of a step, for the metrics: never the full sequence
    loss_model: Any  # LossModel as Accelerate prepared it (DDP or FSDP2)
    optimizer: Any  # as Accelerate prepared it
    raw_optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    coverage: Any  # debug_collectives: the gradient coverage check, else None
    peak: PeakMemory
    start_step: int = 0
    skipped_total: int = 0  # non-finite steps skipped over the whole run, checkpoints included
    skipped_in_row: int = 0
    # preference rows (sigmoid DPO): each row's reference log-probabilities after its first forward
    reference_cache: ReferenceCache = field(default_factory=ReferenceCache)

    @property
    def full_state(self) -> bool:
        """Whether checkpoints hold the frozen weights too: LoRA checkpoints hold the adapter only."""
        return not self.recipe.lora.enabled

    def clipped_parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradient norm is clipped. FSDP2 on CPU: the optimizer's (sharded) parameters; the
        root module may show its unsharded views between steps."""
        if self.world.shard_on_cpu:
            return [p for g in self.raw_optimizer.param_groups for p in g["params"]]
        return [p for p in self.loss_model.parameters() if p.requires_grad]


def lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    """Multiplier of optim.lr after `step` optimizer steps: linear warmup, then cosine/linear/constant."""
    o, total = recipe.optim, recipe.train.steps

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        if o.decay == "constant" or total <= o.warmup_steps:
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.decay == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape

    return f


def build(recipe: Recipe, world: World, say: Callable[[str], None]) -> Run:
    """The model, data, optimizer and LR schedule of a run on this rank, seeded alike on every rank."""
    from accelerate.utils import set_seed

    acc = world.accelerator
    set_seed(recipe.seed)  # identical on every rank: LoRA init must match a single-process run
    model, tokenizer = build_model(recipe.model, recipe.lora, recipe.train, recipe.parallelism, world.cp,
                                   recipe.data.seq_len)
    vocab = model.get_input_embeddings().num_embeddings
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t = recipe.train
    rows_needed = t.steps * t.batch_size + recipe.eval.holdout
    if recipe.data.mix:
        seqs = load_mix(recipe.data, tokenizer, vocab, recipe.seed, main_first=acc.main_process_first,
                        rows_needed=rows_needed, model_name=recipe.model.name)
        schedule: StepSchedule | MixSchedule = MixSchedule(
            [len(p) for p in seqs.parts], [m.weight for m in recipe.data.mix], t.batch_size, t.micro_batch_size,
            world.dp_size, recipe.seed, recipe.data.shuffle)
        say(f"data.mix over {t.steps} steps: {describe(seqs, schedule, t.steps)}")
    else:
        seqs = load_sequences(recipe.data, tokenizer, vocab, recipe.seed, main_first=acc.main_process_first,
                              rows_needed=rows_needed)
    seqs, held_out = split_held_out(recipe, seqs, tokenizer, vocab, main_first=acc.main_process_first)
    stopper = EarlyStopping(recipe.eval.patience, recipe.eval.min_delta)
    if not recipe.data.mix:
        schedule = StepSchedule(len(seqs), t.batch_size, t.micro_batch_size, world.dp_size, recipe.seed,
                                recipe.data.shuffle)
    logit_rows = ChunkStats()
    model.get_output_embeddings().register_forward_hook(logit_rows)
    loss_model = LossModel(model, t.loss_chunk_tokens)
    loss_model, optimizer = world.prepare(loss_model, lambda m: _optimizer(m, recipe))
    coverage = world.reduce_gradients(loss_model)  # DDP: buckets on the grads group (longdoc.train.world)
    _probe_head(loss_model, world, seqs, pad_id, recipe.model.name)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(raw_optimizer, lr_lambda(recipe))
    return Run(recipe=recipe, world=world, say=say, model=model, tokenizer=tokenizer, pad_id=pad_id, seqs=seqs,
               held_out=held_out, schedule=schedule, stopper=stopper, logit_rows=logit_rows, loss_model=loss_model,
               optimizer=optimizer, raw_optimizer=raw_optimizer, scheduler=scheduler, coverage=coverage,
               peak=PeakMemory(world.device), reference_cache=ReferenceCache(recipe.preference.cache_reference))


def resume(run: Run, resume_dir: Path | None, ck_root: Path) -> None:
    """Continue from the checkpoint in `resume_dir` (None: start at step 0), then seed each rank's own streams."""
    from accelerate.utils import set_seed

    recipe, world = run.recipe, run.world
    if resume_dir is not None:
        state = checkpoint.read_state(resume_dir)
        _resume_checks(state, recipe, run.seqs.fingerprint(), world, run.say)
        checkpoint.load(resume_dir, run.loss_model, run.raw_optimizer, frozen_too=run.full_state)
        run.scheduler.load_state_dict(state["scheduler"])
        run.start_step, run.skipped_total = int(state["step"]), int(state.get("skipped", 0))
        run.stopper.load_state_dict(state.get("early_stopping"))
        run.say(f"resumed from step {run.start_step} ({resume_dir})")
    elif recipe.resume == "auto":
        run.say(f"resume=auto: {ck_root} holds no complete checkpoint yet: starting from step 0")
    if resume_dir is None:
        set_seed(recipe.seed + 1 + world.rank)  # per-rank streams from here on (LoRA dropout masks)


def _optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    o = recipe.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RecipeError("nothing to train: every parameter is frozen (check lora.target_modules)")
    decay = [p for p in params if p.dim() >= 2]  # no weight decay on norms and biases
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _probe_head(loss_model, world: World, seqs, pad_id: int, name: str) -> None:
    # A short sequence through both the model's own logits and the chunked path (same on all ranks),
    # after Accelerate placed and wrapped the model, so it runs where and as training will.
    n = max(8, world.cp.multiple) * 2
    ids = seqs.row(0)[0][:n]
    if ids.numel() < n:
        ids = torch.cat([ids, ids.new_full((n - ids.numel(),), pad_id)])
    local = world.cp.shard_batch({"input_ids": ids[None]}, pad_token_id=pad_id)
    check_head(loss_model, local["input_ids"].to(world.device), local["position_ids"].to(world.device), name)


def _resume_checks(state: dict, recipe: Recipe, fingerprint: dict, world: World, say) -> None:
    saved = state.get("recipe", {})
    for key, now in (("model.name", recipe.model.name), ("model.overrides", recipe.model.overrides),
                     ("lora.enabled", recipe.lora.enabled),
                     ("train.batch_size", recipe.train.batch_size), ("seed", recipe.seed)):
        section, _, name = key.rpartition(".")
        was = (saved.get(section, {}) if section else saved).get(name)
        if was != now:
            raise checkpoint.CheckpointError(
                f"cannot resume: the checkpoint was made with {key}={was!r}, this recipe has {now!r}; resuming "
                f"would not continue the same run. Use the original value or a fresh output_dir")
    if state.get("data") != fingerprint:
        say(f"warning: the training data differ from the checkpoint's ({state.get('data')} vs {fingerprint}); "
            f"the data order continues by step number")
    if state.get("world_size") != world.world_size or state.get("cp_size") != world.cp_size:
        say(f"resuming a dp={state.get('dp_size')} x cp={state.get('cp_size')} checkpoint on dp={world.dp_size} x "
            f"cp={world.cp_size}: model and optimizer are resharded by torch.distributed.checkpoint")
