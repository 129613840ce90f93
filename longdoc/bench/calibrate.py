"""The planner's memory formulas against measured peaks of real CPU training runs.

    rows = calibrate([TrainRun(model="tiny", cp=2, seq_len=16384), ...])

The prediction is `longdoc.plan.memory.estimate` in CPU mode (the run's precision, fp32 or bf16 autocast; no FSDP,
DDP's gradient buckets, the "cpu" device's runtime constant), made from the model's config alone. The measurement is the
largest lifetime peak RSS of any rank (`runs.run_steps`). Nothing measured flows into the prediction.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from longdoc.bench.runs import MODELS, RunResult, TrainRun, run_steps
from longdoc.plan.hardware import GIB
from longdoc.plan.memory import MemoryEstimate, Setup, estimate
from longdoc.plan.shapes import ModelShape, model_shape, shape_from_config

TOLERANCE = 0.15

# The acceptance set: tiny and 135M models, cp 1 and 2, 4k to 32k tokens, with and without checkpointing,
# full fine-tuning and LoRA, peaks in the loss and in the backward, in the precision `longdoc plan --gpu cpu`
# assumes here (TrainRun.precision) and one pinned to fp32.
DEFAULT_RUNS = (
    TrainRun(model="tiny", cp=1, seq_len=4096),
    TrainRun(model="tiny", cp=2, seq_len=4096),
    TrainRun(model="tiny", cp=1, seq_len=16384, checkpointing=False),
    TrainRun(model="tiny", cp=2, seq_len=32768, checkpointing=False),
    TrainRun(model="tiny", cp=2, seq_len=32768),
    TrainRun(model="135m", cp=1, seq_len=4096),
    # small loss chunks: the backward is the peak (in fp32; under bf16 autocast the layer's tensors halve and the
    # loss stays the peak), and the fp32 terms stay calibrated now that the other runs default to bf16
    TrainRun(model="135m", cp=2, seq_len=8192, loss_chunk=256, precision="fp32"),
    TrainRun(model="135m", cp=2, seq_len=8192, lora=True),
)
QUICK_RUNS = (TrainRun(model="tiny", cp=1, seq_len=2048), TrainRun(model="tiny", cp=2, seq_len=2048))


def run_shape(run: TrainRun) -> ModelShape:
    """The shape of the model `run` trains, at its depth: SmolLM2-135M's published config (at reduced depth the
    same layers fewer times), the random-init models' own configs (the hybrid's layer mix depends on the depth)."""
    return _shape(run.model, run.layers)


@functools.lru_cache(maxsize=64)
def _shape(model: str, layers: int | None) -> ModelShape:
    if model == "135m":
        shape = model_shape(MODELS[model])
        return shape if layers is None else shape.with_layers(layers)
    from longdoc import models

    overrides = TrainRun(model=model, layers=layers).overrides() or {}
    config = models.tiny_config(models.arch_of(MODELS[model]), **{**models.DEFAULT_TOKEN_IDS, **overrides})
    return shape_from_config(config, name=f"{MODELS[model]} ({config.num_hidden_layers} layers, bench shape)")


def setup_for(run: TrainRun) -> Setup:
    # The runs are launched ranks, so Accelerate wraps even cp=1 in DDP (gradient buckets P_t*4) unless FSDP shards.
    shape = run_shape(run)
    if shape.max_positions and run.seq_len > shape.max_positions:  # the run extends the context (TrainRun.recipe)
        shape = dataclasses.replace(shape, max_positions=run.seq_len)
    return Setup(shape=shape, seq_len=run.seq_len, cp=run.cp, dp=1, checkpointing=run.checkpointing,
                 loss_chunk=run.loss_chunk, lora=run.lora, device="cpu", precision=run.precision, ddp=True,
                 fsdp=run.fsdp, tiled_mlp=run.tiled_mlp, offload=run.offload, steps=run.steps)


def predict(run: TrainRun) -> MemoryEstimate:
    return estimate(setup_for(run))


@dataclass
class Calibration:
    run: TrainRun
    predicted_gib: float
    measured_gib: float
    peak_phase: str
    result: RunResult

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return self.predicted_gib / self.measured_gib - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE

    def to_dict(self) -> dict:
        return {"run": self.run.label(), "precision": self.run.precision, "predicted_gib": self.predicted_gib,
                "measured_gib": self.measured_gib,
                "error": self.error, "within_tolerance": self.ok, "peak_phase": self.peak_phase,
                "rank_peaks_gib": self.result.rank_peaks_gib, "step_peaks_gib": self.result.step_peaks_gib,
                "step_s": self.result.step_s}


def compare(run: TrainRun, result: RunResult) -> Calibration:
    est = predict(run)
    return Calibration(run=run, predicted_gib=est.total / GIB, measured_gib=result.peak_gib,
                       peak_phase=est.peak_phase, result=result)


def calibrate(runs=DEFAULT_RUNS, log=print) -> list[Calibration]:
    out = []
    for run in runs:
        cal = compare(run, run_steps(run))
        log(f"  {run.label():<22} predicted {cal.predicted_gib:6.3f} GiB, measured {cal.measured_gib:6.3f} GiB "
            f"({cal.error:+.1%}, peak in {cal.peak_phase})")
        out.append(cal)
    return out


def to_markdown(rows: list[Calibration]) -> str:
    lines = ["| run | precision | predicted GiB | measured peak RSS GiB | error | planner's peak phase |",
             "|---|---|---:|---:|---:|---|"]
    for c in rows:
        lines.append(f"| {c.run.label()} | {c.run.precision} | {c.predicted_gib:.3f} | {c.measured_gib:.3f} | "
                     f"{c.error:+.1%} | {c.peak_phase} |")
    return "\n".join(lines)
