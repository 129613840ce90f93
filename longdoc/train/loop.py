"""The training loop: build the run, resume it, then per optimizer step `train_step` (longdoc.train.step) and
the after-step hooks (log, validate, checkpoint); at the end the exported model and the loss plot.

    # 2 CPU processes, cp=2 (the CPU demo):
    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train recipes/cpu-demo.yaml
    # one node, 8 GPUs:
    accelerate launch --config_file recipes/accelerate/1node-8gpu.yaml -m longdoc train recipes/legal-32k.yaml
    # one process, overrides, resume:
    longdoc train recipes/cpu-demo.yaml parallelism.cp_size=1 train.steps=4 resume=true

One optimizer step is every micro-batch of every data-parallel replica; how the loss shares of the ranks add up
to the step's exact token-mean gradient is in longdoc.train.step.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from longdoc.train import checkpoint
from longdoc.train.config import Recipe, RecipeError
from longdoc.train.metrics import JSONLTracker, Progress, plot_loss
from longdoc.train.modeling import export, trainable_parameters
from longdoc.train.run import Run, Say, build, resume
from longdoc.train.step import StepInfo, train_step
from longdoc.train.validation import due, extra_trackers, validation_loss
from longdoc.train.world import World, start


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


def _check_output(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        # a name of its own on every rank (ranks forked from one server share object ids) and every node
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise RecipeError(f"output_dir {out} is not writable ({e}); choose another output_dir=...") from e


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
    say = Say(world.is_main)
    if world.is_main:
        if recipe.overwrite:
            checkpoint.remove_all(ck_root)
        checkpoint.sweep(ck_root)
    world.accelerator.wait_for_everyone()
    run = build(recipe, world, say)
    resume(run, resume_dir, ck_root)
    _start_logging(run, out, tracker_kwargs)
    say.progress = progress = Progress(recipe.train.steps, run.start_step, recipe.log.progress and world.is_main)
    history: list[StepInfo] = []
    params = run.clipped_parameters()
    last_ckpt, stopped_early = checkpoint.latest(ck_root), False
    for step in range(run.start_step, recipe.train.steps):
        info, local_tokens = train_step(run, step, params)
        history.append(info)
        progress.update(info.loss, info.tokens / info.step_s, info.step_s, info.peak_gb_max, info.lr)
        _log(run, info, local_tokens)
        stopped_early = _validate(run, info)
        if on_step is not None:
            on_step(info)
        last_ckpt = _checkpoint(run, info, ck_root, stopped_early) or last_ckpt
        if stopped_early:
            break
    progress.close()
    return _finish(run, out, history, last_ckpt, stopped_early)


def _start_logging(run: Run, out: Path, tracker_kwargs: dict) -> None:
    """The effective recipe in OUTPUT/recipe.yaml, the trackers' config, and the run's one-line summary."""
    recipe, world = run.recipe, run.world
    if world.is_main:
        (out / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    flat = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in recipe.flat().items()}
    world.accelerator.init_trackers("tensorboard", config=flat, init_kwargs=tracker_kwargs)
    n_train, n_total = trainable_parameters(run.model)
    run.say(f"longdoc train: world {world.world_size} = dp {world.dp_size} x cp {world.cp_size} on "
            f"{world.device.type}, {run.schedule.accum} micro-batch(es) of {recipe.train.micro_batch_size} x "
            f"{recipe.data.seq_len} tokens per replica per step; {len(run.seqs)} sequences from {run.seqs.source}; "
            f"trainable {n_train:,} of {n_total:,} params; mixed precision {world.mixed_precision}")


def _log(run: Run, info: StepInfo, local_tokens: int) -> None:
    """The step's metrics to every tracker, every log.every steps and at the last."""
    recipe = run.recipe
    if info.step % recipe.log.every and info.step != recipe.train.steps:
        return
    run.world.accelerator.log(
        {"loss": info.loss, "lr": info.lr, "grad_norm": info.grad_norm, "tokens": info.tokens,
         "tokens_per_s": info.tokens / info.step_s, "step_s": info.step_s, "peak_gb": info.peak_gb,
         "peak_gb_max": info.peak_gb_max, "epoch": run.schedule.epoch(info.step), "skipped": run.skipped_total,
         "logit_rows_max": run.logit_rows.max_rows, "local_tokens": local_tokens,
         **({"aux_loss": info.aux_loss} if info.aux_loss is not None else {}), **(info.metrics or {})},
        step=info.step)


def _validate(run: Run, info: StepInfo) -> bool:
    """The held-out loss when eval.every (or eval.at_end) says so, into `info`; whether early stopping ends the run."""
    recipe, stopper, step = run.recipe, run.stopper, info.step
    if run.held_out is None or not due(recipe.eval, step, step == recipe.train.steps):
        return False
    info.val_loss = validation_loss(run.loss_model, run.world, run.held_out, recipe.train.micro_batch_size,
                                    run.pad_id)
    stopped_early = stopper.update(info.val_loss, step)
    run.world.accelerator.log({"val_loss": info.val_loss, "val_best": stopper.best}, step=step)
    run.say(f"step {step}: validation loss {info.val_loss:.4f} on {len(run.held_out)} held-out rows "
            f"(best {stopper.best:.4f} at step {stopper.best_step})")
    if stopped_early:
        run.say(f"early stopping at step {step}: no validation loss below {stopper.best:.4f} - "
                f"{recipe.eval.min_delta} for {stopper.bad} validations (eval.patience={recipe.eval.patience})")
    return stopped_early


def _checkpoint(run: Run, info: StepInfo, ck_root: Path, stopped_early: bool) -> Path | None:
    """A checkpoint every checkpoint.every steps and at the end (checkpoint.at_end); its folder, or None."""
    recipe, world, step = run.recipe, run.world, info.step
    every = recipe.checkpoint.every
    is_last = step == recipe.train.steps or stopped_early
    if not ((every and step % every == 0) or (is_last and recipe.checkpoint.at_end)):
        return None
    return checkpoint.save(
        ck_root, step, run.loss_model, run.raw_optimizer,
        {"step": step, "scheduler": run.scheduler.state_dict(), "skipped": run.skipped_total,
         "world_size": world.world_size, "dp_size": world.dp_size, "cp_size": world.cp_size,
         "data": run.seqs.fingerprint(), "loss": info.loss, "recipe": recipe.to_dict(),
         "early_stopping": run.stopper.state_dict()},
        keep=recipe.checkpoint.keep, frozen_too=run.full_state)


def _finish(run: Run, out: Path, history: list[StepInfo], last_ckpt: Path | None, stopped_early: bool) -> TrainResult:
    """The exported model (when this run trained a step), the trackers closed, the loss plot."""
    recipe, world = run.recipe, run.world
    final_dir = None
    steps_done = history[-1].step if history else run.start_step
    if recipe.checkpoint.export and steps_done > run.start_step:
        final_dir = _export(world, run.loss_model, run.tokenizer, out / "final", recipe)
    world.accelerator.end_training()
    if world.is_main and recipe.log.plot and (out / "metrics.jsonl").is_file():
        plot_loss(out / "metrics.jsonl", out / "loss.png", f"{recipe.model.name}: {Path(out).name}")
    return TrainResult(out, steps_done, history, final_dir, last_ckpt, world.is_main, world.world_size,
                       world.cp_size, stopped_early)


def _export(world: World, loss_model, tokenizer, out: Path, recipe: Recipe) -> Path:
    acc = world.accelerator
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
