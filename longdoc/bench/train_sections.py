"""Training benchmarks on CPU ranks: throughput cp=1 vs cp=2, and peak memory vs cp.

Both run the real trainer (`runs.run_steps`) in fresh processes and put the planner's prediction next
to each measurement, so every run is also a calibration point.
  throughput  tokens/s of steady-state steps, cp=1 (1 process x T threads) vs cp=2 (2 ranks x T/2 threads)
              at equal total cores, for the tiny and the 135M model;
  memory      per-rank peak RSS at one total length for cp = 1, 2, 4: the activation part falls like 1/cp,
              the model state and the runtime stay.
The longest sequence under a per-process cap, per model, cp and memory feature, is `longdoc.bench.longest`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from longdoc.bench.calibrate import compare, predict
from longdoc.bench.runs import TrainRun, run_steps
from longdoc.plan.hardware import GIB


@dataclass(kw_only=True)
class TrainBenchConfig:
    # Every run is configured as `longdoc train` runs by default (freed memory returned to the OS on CPU).
    throughput: tuple[TrainRun, ...] = tuple(
        TrainRun(model=m, cp=cp, seq_len=n, steps=3)
        for m, n in (("tiny", 16384), ("135m", 4096)) for cp in (1, 2))
    memory_run: TrainRun = TrainRun(model="tiny", seq_len=16384, checkpointing=False)
    memory_cps: tuple[int, ...] = (1, 2, 4)


QUICK = TrainBenchConfig(
    throughput=tuple(TrainRun(model="tiny", cp=cp, seq_len=4096, steps=2) for cp in (1, 2)),
    memory_run=TrainRun(model="tiny", seq_len=4096, checkpointing=False), memory_cps=(1, 2),
)


@dataclass
class Measured:
    """One real run with its prediction."""

    run: TrainRun
    peak_gib: float
    predicted_gib: float
    tokens_per_s: float
    step_s: list[float]
    rank_peaks_gib: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"run": self.run.label(), "cp": self.run.cp, "seq_len": self.run.seq_len, "model": self.run.model,
                "checkpointing": self.run.checkpointing, "lora": self.run.lora, "peak_gib": self.peak_gib,
                "predicted_gib": self.predicted_gib, "error": self.predicted_gib / self.peak_gib - 1,
                "tokens_per_s": self.tokens_per_s, "step_s": self.step_s, "rank_peaks_gib": self.rank_peaks_gib,
                "threads_per_rank": self.run.rank_threads}


def measure(run: TrainRun, log=print) -> Measured:
    cal = compare(run, run_steps(run))
    m = Measured(run=run, peak_gib=cal.measured_gib, predicted_gib=cal.predicted_gib,
                 tokens_per_s=cal.result.tokens_per_s, step_s=cal.result.step_s,
                 rank_peaks_gib=cal.result.rank_peaks_gib)
    log(f"  {run.label():<22} {m.tokens_per_s:9.1f} tokens/s  peak {m.peak_gib:.3f} GiB "
        f"(planner {m.predicted_gib:.3f}, {m.predicted_gib / m.peak_gib - 1:+.1%})")
    return m


Measure = Callable[[TrainRun], Measured]


def throughput(cfg: TrainBenchConfig, measure_fn: Measure = measure) -> list[Measured]:
    return [measure_fn(r) for r in cfg.throughput]


def memory_vs_cp(cfg: TrainBenchConfig, measure_fn: Measure = measure) -> dict:
    rows = []
    for cp in cfg.memory_cps:
        run = dataclasses.replace(cfg.memory_run, cp=cp, threads=1)
        m = measure_fn(run)
        est = predict(run)
        b = est.breakdown
        fixed = (b["weights"] + b["optimizer"] + b["grads"] + b["runtime"]) / GIB
        rows.append(m.to_dict() | {"predicted_fixed_gib": fixed, "predicted_scaling_gib": est.total_gib - fixed})
    return {"run": cfg.memory_run.label(), "rows": rows}


def throughput_markdown(rows: list[Measured]) -> str:
    lines = ["| model | tokens | cp x threads | tokens/s | step s (steady) | peak GiB/rank | planner GiB |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for m in rows:
        steady = m.step_s[1:] or m.step_s
        lines.append(f"| {m.run.model} | {m.run.seq_len:,} | {m.run.cp} x {m.run.rank_threads} | "
                     f"{m.tokens_per_s:,.0f} | {sum(steady) / len(steady):.2f} | {m.peak_gib:.3f} | "
                     f"{m.predicted_gib:.3f} |")
    return "\n".join(lines)


def memory_markdown(result: dict) -> str:
    lines = [f"Fixed total length: {result['run'].split(' cp')[0]} model, {result['rows'][0]['seq_len']:,} tokens",
             "", "| cp | peak GiB per rank (measured) | planner | planner: state + runtime | planner: the rest |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['cp']} | {r['peak_gib']:.3f} | {r['predicted_gib']:.3f} | {r['predicted_fixed_gib']:.3f} | "
                     f"{r['predicted_scaling_gib']:.3f} |")
    return "\n".join(lines)
