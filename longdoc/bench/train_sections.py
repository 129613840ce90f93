"""Training benchmarks on CPU ranks: throughput cp=1 vs cp=2, peak memory vs cp, the longest sequence under a cap.

All three run the real trainer (`runs.run_steps`) in fresh processes and put the planner's prediction next
to each measurement, so every run is also a calibration point.
  throughput  tokens/s of steady-state steps, cp=1 (1 process x T threads) vs cp=2 (2 ranks x T/2 threads)
              at equal total cores, for the tiny and the 135M model;
  memory      per-rank peak RSS at one total length for cp = 1, 2, 4: the activation part falls like 1/cp,
              the model state and the runtime stay;
  longest     the longest sequence (a multiple of `step`) whose 3-step run stays under a per-process cap, for
              cp=1 and cp=2: the search starts where the planner says and probes real runs up or down.
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
    cap_run: TrainRun = TrainRun(model="tiny", seq_len=4096, checkpointing=False)
    cap_gib: float = 2.0
    cap_cps: tuple[int, ...] = (1, 2)
    cap_step: int = 4096
    cap_max_probes: int = 4


QUICK = TrainBenchConfig(
    throughput=tuple(TrainRun(model="tiny", cp=cp, seq_len=4096, steps=2) for cp in (1, 2)),
    memory_run=TrainRun(model="tiny", seq_len=4096, checkpointing=False), memory_cps=(1, 2),
    cap_run=TrainRun(model="tiny", seq_len=2048, checkpointing=False), cap_gib=1.5, cap_step=2048, cap_max_probes=2,
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


def _predicted_longest(run: TrainRun, cap_gib: float, step: int) -> int:
    lo, hi = 0, step
    while predict(dataclasses.replace(run, seq_len=hi)).total_gib <= cap_gib and hi < 1 << 22:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if predict(dataclasses.replace(run, seq_len=mid)).total_gib <= cap_gib else (lo, mid)
    return lo


def longest_under_cap(cfg: TrainBenchConfig, measure_fn: Measure = measure, log=print) -> dict:
    """For each cp: the planner's longest length under the cap, then real runs from there up or down."""
    rows = []
    for cp in cfg.cap_cps:
        base = dataclasses.replace(cfg.cap_run, cp=cp, threads=1)
        predicted = _predicted_longest(base, cfg.cap_gib, cfg.cap_step)
        probes: list[Measured] = []
        n = max(cfg.cap_step, predicted)
        fits_at, over_at = 0, None
        for _ in range(cfg.cap_max_probes):
            m = measure_fn(dataclasses.replace(base, seq_len=n))
            probes.append(m)
            if m.peak_gib <= cfg.cap_gib:
                fits_at = max(fits_at, n)
                if over_at is not None and n + cfg.cap_step >= over_at:
                    break
                n += cfg.cap_step
            else:
                over_at = n if over_at is None else min(over_at, n)
                if n - cfg.cap_step <= fits_at or n <= cfg.cap_step:
                    break
                n -= cfg.cap_step
        rows.append({"cp": cp, "predicted_longest": predicted, "measured_longest": fits_at,
                     "first_over": over_at, "probes": [p.to_dict() for p in probes]})
        log(f"  longest under {cfg.cap_gib} GiB with cp={cp}: measured {fits_at:,} tokens "
            f"(planner {predicted:,}; {len(probes)} probe runs)")
    return {"cap_gib": cfg.cap_gib, "run": cfg.cap_run.label(), "step": cfg.cap_step, "rows": rows}


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


def longest_markdown(result: dict) -> str:
    lines = [f"Per-process cap {result['cap_gib']} GiB, {result['run'].split(' cp')[0]} model, steps of "
             f"{result['step']:,} tokens", "", "| cp | longest measured | planner's longest | probes (tokens: GiB) |",
             "|---:|---:|---:|---|"]
    for r in result["rows"]:
        probes = ", ".join(f"{p['seq_len'] // 1024}k: {p['peak_gib']:.2f}" for p in r["probes"])
        lines.append(f"| {r['cp']} | {r['measured_longest']:,} | {r['predicted_longest']:,} | {probes} |")
    return "\n".join(lines)
