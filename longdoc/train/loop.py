"""The training loop: one optimizer step = every micro-batch of every data-parallel replica.

    # 2 CPU processes, cp=2 (the CPU demo):
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml
    # one node, 8 GPUs:
    accelerate launch --config_file recipes/accelerate/1node-8gpu.yaml -m longdoc train recipes/legal-32k.yaml
    # one process, overrides, resume:
    longdoc train recipes/cpu-demo.yaml cp_size=1 train.steps=4 resume=true

Gradient scaling, exactly: each rank's loss is its SHARE, sum(its token CE) / N, where N is the number
of loss tokens in the whole optimizer step (all micro-batches, all replicas). The sum of the shares
over every rank and micro-batch is the step's token-mean loss, and the sum of their gradients is its
gradient. DDP and FSDP2 AVERAGE gradients over the world (dp x cp ranks), so each share is multiplied
by the world size before backward: the average of world_size x shares is the sum of shares.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from longdoc.hf import router
from longdoc.parallel.batch import ROW_LENGTHS
from longdoc.train import checkpoint
from longdoc.train.config import Recipe, RecipeError
from longdoc.train.data import (
    StepSchedule,
    collate,
    load_sequences,
    num_tokens,
    shard_target_weights,
    step_denominators,
)
from longdoc.train.loss import ChunkStats, LossModel, base_causal_lm, check_head
from longdoc.train.metrics import JSONLTracker, PeakMemory, Progress, plot_loss
from longdoc.train.mix import MixSchedule, describe, load_mix
from longdoc.train.modeling import build, export, trainable_parameters
from longdoc.train.validation import EarlyStopping, due, extra_trackers, split_held_out, validation_loss
from longdoc.train.world import World, start


@dataclass
class StepInfo:
    step: int  # optimizer steps done (1-based after the update)
    loss: float  # token-mean loss of the step, all ranks
    lr: float
    grad_norm: float
    tokens: int  # real tokens in the step, all replicas
    step_s: float
    peak_gb: float  # this rank
    peak_gb_max: float  # the largest over all ranks
    skipped: bool
    world: World | None = field(default=None, repr=False)
    val_loss: float | None = None  # held-out token-mean loss, on steps that validated
    aux_loss: float | None = None  # MoE models: the router auxiliary loss, mean over the step's forwards


@dataclass
class TrainResult:
    output_dir: Path
    steps_done: int
    history: list[StepInfo]
    final_dir: Path | None
    last_checkpoint: Path | None
    is_main: bool = True
    world_size: int = 1
    cp_size: int = 1
    stopped_early: bool = False  # eval.patience validations without improvement ended the run

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        return [(s.step, s.val_loss) for s in self.history if s.val_loss is not None]

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.history]

    def tokens_per_s(self, skip_first: bool = True) -> float:
        rows = self.history[1:] if skip_first and len(self.history) > 1 else self.history
        t = sum(r.step_s for r in rows)
        return sum(r.tokens for r in rows) / t if t > 0 else 0.0


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


def _optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    o = recipe.optim
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RecipeError("nothing to train: every parameter is frozen (check lora.target_modules)")
    decay = [p for p in params if p.dim() >= 2]  # no weight decay on norms and biases
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _check_output(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{id(out)}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RecipeError(f"output_dir {out} is not writable ({e}); choose another output_dir=...") from e


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


def train(recipe: Recipe, *, on_step: Callable[[StepInfo], None] | None = None) -> TrainResult:
    """Run (or resume) the recipe on every launched rank; return the loss history and output paths."""
    out = Path(recipe.output_dir)
    ck_root = out / "checkpoints"
    _check_output(out)
    # before the first collective, alike on every rank (the parent process checked it too: train.preflight)
    resume_dir = checkpoint.starting_point(ck_root, recipe.resume, recipe.overwrite)
    resume_step = checkpoint.read_state(resume_dir)["step"] if resume_dir else None
    trackers: list = [JSONLTracker(out / "metrics.jsonl", resume_step)]
    if recipe.log.tensorboard:
        trackers.append("tensorboard")
    more_trackers, tracker_kwargs = extra_trackers(recipe.log, out)
    trackers += more_trackers
    world = start(recipe, log_with=trackers)
    finished = False
    try:
        result = _train(recipe, world, on_step, out, ck_root, resume_dir, tracker_kwargs)
        finished = True
        return result
    finally:  # a rank that raised stops its heartbeat without "done": its peers report it lost
        world.close(finished)


def _train(recipe: Recipe, world: World, on_step, out: Path, ck_root: Path, resume_dir, tracker_kwargs) -> TrainResult:
    from accelerate.utils import set_seed

    acc = world.accelerator

    def say(msg: str) -> None:
        if not world.is_main:
            return
        if progress is not None:
            progress.write(msg)  # above the bar, not through it
        else:
            print(msg, flush=True)

    progress = None
    if world.is_main:
        if recipe.overwrite:
            checkpoint.remove_all(ck_root)
        checkpoint.sweep(ck_root)
    acc.wait_for_everyone()
    set_seed(recipe.seed)  # identical on every rank: LoRA init must match a single-process run
    model, tokenizer = build(recipe.model, recipe.lora, recipe.train, world.cp, recipe.data.seq_len)
    vocab = model.get_input_embeddings().num_embeddings
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows_needed = recipe.train.steps * recipe.train.batch_size + recipe.eval.holdout
    if recipe.data.mix:
        seqs = load_mix(recipe.data, tokenizer, vocab, recipe.seed, main_first=acc.main_process_first,
                        rows_needed=rows_needed, model_name=recipe.model.name)
        schedule = MixSchedule([len(p) for p in seqs.parts], [m.weight for m in recipe.data.mix],
                               recipe.train.batch_size, recipe.train.micro_batch_size, world.dp_size, recipe.seed,
                               recipe.data.shuffle)
        say(f"data.mix over {recipe.train.steps} steps: {describe(seqs, schedule, recipe.train.steps)}")
    else:
        seqs = load_sequences(recipe.data, tokenizer, vocab, recipe.seed, main_first=acc.main_process_first,
                              rows_needed=rows_needed)
    seqs, held_out = split_held_out(recipe, seqs, tokenizer, vocab, main_first=acc.main_process_first)
    stopper = EarlyStopping(recipe.eval.patience, recipe.eval.min_delta)
    if not recipe.data.mix:
        schedule = StepSchedule(len(seqs), recipe.train.batch_size, recipe.train.micro_batch_size, world.dp_size,
                                recipe.seed, recipe.data.shuffle)
    logit_rows = ChunkStats()  # the largest logits block per step goes to the metrics: never the full sequence
    model.get_output_embeddings().register_forward_hook(logit_rows)
    loss_model = LossModel(model, recipe.train.loss_chunk_tokens)
    loss_model, optimizer = world.prepare(loss_model, lambda m: _optimizer(m, recipe))
    coverage = world.reduce_gradients(loss_model)  # DDP: buckets on the grads group (longdoc.train.world)
    _probe_head(loss_model, world, seqs, pad_id, recipe.model.name)
    raw_optimizer = getattr(optimizer, "optimizer", optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(raw_optimizer, lr_lambda(recipe))
    full_state = not recipe.lora.enabled  # LoRA checkpoints hold the adapter only (the base is frozen)
    start_step, skipped_total = 0, 0
    if resume_dir is not None:
        state = checkpoint.read_state(resume_dir)
        _resume_checks(state, recipe, seqs.fingerprint(), world, say)
        checkpoint.load(resume_dir, loss_model, raw_optimizer, frozen_too=full_state)
        scheduler.load_state_dict(state["scheduler"])
        start_step, skipped_total = int(state["step"]), int(state.get("skipped", 0))
        stopper.load_state_dict(state.get("early_stopping"))
        say(f"resumed from step {start_step} ({resume_dir})")
    elif recipe.resume == "auto":
        say(f"resume=auto: {ck_root} holds no complete checkpoint yet: starting from step 0")
    if resume_dir is None:
        set_seed(recipe.seed + 1 + world.rank)  # per-rank streams from here on (LoRA dropout masks)

    if world.is_main:
        (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    flat = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in recipe.flat().items()}
    acc.init_trackers("tensorboard", config=flat, init_kwargs=tracker_kwargs)
    n_train, n_total = trainable_parameters(model)
    say(f"longdoc train: world {world.world_size} = dp {world.dp_size} x cp {world.cp_size} on {world.device.type}, "
        f"{schedule.accum} micro-batch(es) of {recipe.train.micro_batch_size} x {recipe.data.seq_len} tokens per "
        f"replica per step; {len(seqs)} sequences from {seqs.source}; trainable {n_train:,} of {n_total:,} params; "
        f"mixed precision {world.mixed_precision}")
    progress = Progress(recipe.train.steps, start_step, recipe.log.progress and world.is_main)
    peak = PeakMemory(world.device)
    history: list[StepInfo] = []
    # FSDP2 on CPU: the optimizer's (sharded) parameters; the root module may show its unsharded views between steps
    params = [p for g in raw_optimizer.param_groups for p in g["params"]] if world.shard_on_cpu else \
        [p for p in loss_model.parameters() if p.requires_grad]
    last_ckpt, skipped_in_row = checkpoint.latest(ck_root), 0
    stopped_early = False
    for step in range(start_step, recipe.train.steps):
        peak.reset()
        logit_rows.max_rows = 0
        t0 = time.perf_counter()
        step_idx = schedule.step_indices(step)
        loss, grad_norm, local_tokens, aux = _forward_backward(acc, world, loss_model, params, seqs, schedule,
                                                               step, pad_id, recipe.optim.max_grad_norm, coverage)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            skipped_in_row = 0
        else:
            skipped_total += 1
            skipped_in_row += 1
            if recipe.train.on_nonfinite == "abort" or skipped_in_row > recipe.train.max_skipped_steps:
                raise FloatingPointError(
                    f"step {step + 1}: loss {loss} / gradient norm {grad_norm} is not finite"
                    + ("" if recipe.train.on_nonfinite == "abort" else
                       f" for {skipped_in_row} steps in a row (train.max_skipped_steps)")
                    + "; lower optim.lr, check the data, or use fp32 (model.dtype=float32)")
            say(f"warning: step {step + 1} skipped: non-finite loss {loss} or gradient norm {grad_norm} "
                f"({skipped_total} skipped so far)")
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step_s = time.perf_counter() - t0
        tokens = num_tokens(seqs, step_idx)
        mine = peak.peak_gb()
        (peak_max,) = world.all_reduce([mine], dist.ReduceOp.MAX, "peak memory")
        info = StepInfo(step + 1, loss, lr, grad_norm, tokens, step_s, mine, peak_max, not finite, world)
        info.aux_loss = aux if acc.unwrap_model(loss_model).aux is not None else None
        history.append(info)
        progress.update(loss, tokens / step_s, step_s, peak_max, lr)
        if (step + 1) % recipe.log.every == 0 or step + 1 == recipe.train.steps:
            acc.log({"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                     "tokens_per_s": tokens / step_s, "step_s": step_s, "peak_gb": mine, "peak_gb_max": peak_max,
                     "epoch": schedule.epoch(step + 1), "skipped": skipped_total,
                     "logit_rows_max": logit_rows.max_rows, "local_tokens": local_tokens,
                     **({"aux_loss": info.aux_loss} if info.aux_loss is not None else {})},
                    step=step + 1)
        if held_out is not None and due(recipe.eval, step + 1, step + 1 == recipe.train.steps):
            info.val_loss = validation_loss(loss_model, world, held_out, recipe.train.micro_batch_size, pad_id)
            stopped_early = stopper.update(info.val_loss, step + 1)
            acc.log({"val_loss": info.val_loss, "val_best": stopper.best}, step=step + 1)
            say(f"step {step + 1}: validation loss {info.val_loss:.4f} on {len(held_out)} held-out rows "
                f"(best {stopper.best:.4f} at step {stopper.best_step})")
            if stopped_early:
                say(f"early stopping at step {step + 1}: no validation loss below {stopper.best:.4f} - "
                    f"{recipe.eval.min_delta} for {stopper.bad} validations (eval.patience={recipe.eval.patience})")
        if on_step is not None:
            on_step(info)
        every = recipe.checkpoint.every
        is_last = step + 1 == recipe.train.steps or stopped_early
        if (every and (step + 1) % every == 0) or (is_last and recipe.checkpoint.at_end):
            last_ckpt = checkpoint.save(
                ck_root, step + 1, loss_model, raw_optimizer,
                {"step": step + 1, "scheduler": scheduler.state_dict(), "skipped": skipped_total,
                 "world_size": world.world_size, "dp_size": world.dp_size, "cp_size": world.cp_size,
                 "data": seqs.fingerprint(), "loss": loss, "recipe": recipe.to_dict(),
                 "early_stopping": stopper.state_dict()},
                keep=recipe.checkpoint.keep, frozen_too=full_state)
        if stopped_early:
            break
    progress.close()
    final_dir = None
    steps_done = history[-1].step if history else start_step
    if recipe.checkpoint.export and steps_done > start_step:
        final_dir = _export(acc, world, loss_model, tokenizer, out / "final", recipe)
    acc.end_training()
    if world.is_main and recipe.log.plot and (out / "metrics.jsonl").is_file():
        plot_loss(out / "metrics.jsonl", out / "loss.png", f"{recipe.model.name}: {Path(out).name}")
    return TrainResult(out, steps_done, history, final_dir, last_ckpt, world.is_main, world.world_size,
                       world.cp_size, stopped_early)


def _forward_backward(acc, world: World, loss_model, params, seqs, schedule: StepSchedule, step: int, pad_id: int,
                      max_grad_norm: float | None, coverage=None) -> tuple[float, float, int]:
    """Every micro-batch of this replica for optimizer `step`; gradients reduced over the world and clipped.

    Returns (the step's loss over all ranks: token-mean CE + coef x mean router aux, the global gradient norm
    before clipping, the local tokens per micro-batch on this rank, the mean router auxiliary loss or 0).
    """
    # the whole step, every replica: the denominators (sum of loss weights, number of KL tokens)
    n_loss, n_kl = step_denominators(seqs, schedule.step_indices(step))
    micro = schedule.micro_batches(step, world.dp_rank)
    loss_sum = torch.zeros((), dtype=torch.float64)
    aux_sum = torch.zeros((), dtype=torch.float64)
    # MoE router auxiliary loss: each forward's (its whole sequence's) x coef, averaged over the step's forwards;
    # every CP rank holds the same value and takes a 1/cp share
    forwards = len(micro) * world.dp_size * world.cp_size
    aux_weight = router.coefficient(base_causal_lm(acc.unwrap_model(loss_model).model)) / forwards
    local_tokens = 0
    for m, idx in enumerate(micro):
        full = collate(seqs, idx, pad_id, step)
        weights, kl = full.pop("loss_weights", None), full.pop("kl_weights", None)
        local = world.cp.shard_batch(full, pad_token_id=pad_id)
        local_tokens = int(local["input_ids"].numel())
        extra = {}
        if weights is not None:
            extra["loss_weights"] = shard_target_weights(full, weights, world.cp).to(world.device)
        # decided from the full batch, so every CP rank of the group runs the base's forward or none does
        if kl is not None and bool((kl > 0).any()):
            extra.update(kl_weights=shard_target_weights(full, kl, world.cp).to(world.device), num_kl_tokens=n_kl)
        # DDP reduces gradients once, in the backward of the last micro-batch
        sync = contextlib.nullcontext() if m == len(micro) - 1 else acc.no_sync(loss_model)
        with sync:
            cu = local.get("cu_seq_lens_q")  # packed rows: the documents' global boundaries
            lengths = local.get(ROW_LENGTHS)  # padded rows: their real lengths
            share, _ = loss_model(local["input_ids"].to(world.device), local["position_ids"].to(world.device),
                                  local["shift_labels"].to(world.device), n_loss,
                                  cu_seq_lens=cu.to(world.device) if cu is not None else None,
                                  row_lengths=lengths.to(world.device) if lengths is not None else None,
                                  aux_weight=aux_weight, **extra)
            acc.backward(share * world.world_size)  # undo DDP/FSDP's average over the world (docstring)
        if coverage is not None:  # debug_collectives: before this rank issues anything else
            coverage.check(f"step {step + 1}, micro-batch {m + 1}")
        loss_sum += share.detach().double().cpu()
        aux = acc.unwrap_model(loss_model).aux
        if aux is not None:
            aux_sum += float(aux.detach()) / forwards
    grad_norm = acc.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
        grad_norm = grad_norm.full_tensor()
    grad_norm = float(grad_norm) if grad_norm is not None else 0.0
    loss, aux = world.all_reduce([float(loss_sum), float(aux_sum)], dist.ReduceOp.SUM, "loss")
    return loss, grad_norm, local_tokens, aux


def _export(acc, world: World, loss_model, tokenizer, out: Path, recipe: Recipe) -> Path:
    state_dict = None
    if world.shard_on_cpu:  # the full weights gathered from the FSDP2 shards (a collective: every rank)
        state_dict = {k.removeprefix("model."): v for k, v in world.full_state_dict(loss_model).items()}
    elif world.fsdp:
        full = acc.get_state_dict(loss_model)  # collective: every rank takes part
        state_dict = {k.removeprefix("model."): v for k, v in (full or {}).items()}
    if world.is_main:
        inner = acc.unwrap_model(loss_model).model
        export(inner, tokenizer, out, recipe.lora.merge_on_export, state_dict)
    acc.wait_for_everyone()
    return out
