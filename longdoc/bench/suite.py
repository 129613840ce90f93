"""`longdoc bench`: every section in one run, one JSON, one markdown report, PNG plots.

    longdoc bench                         # all sections (make bench); --quick for a smoke run
    longdoc bench attention memory        # some sections
    longdoc bench --publish docs/bench    # also publish bench.json and the plots there (the docs render them)

Sections: attention (CP efficiency E, zigzag gain Z, ring vs all-gather, across lengths), hybrid (a Granite-4.0-H-shaped
Mamba2 + attention model at 16k: E, peak memory, state-exchange vs ring bytes), train (tokens/s, cp=1 vs cp=2 at equal
cores, tiny and 135M), memory (peak per rank vs cp), longest (the longest trainable sequence under a per-process cap for
135M full fine-tuning, LoRA and a hybrid, cp 1/2/4, each memory feature on and off: measured at reduced depth, carried
to full depth by the planner; longdoc.bench.longest), calibration (planner vs measured peaks of every CPU run made), dsa
(sparse indexed attention: a tiny DeepSeek-V3.2 at 16k tokens, one process vs CP, DSA vs dense causal), kinds (per-rank
tracked activation bytes and RSS growth at cp=2 vs one process at 8k, for attention, Mamba2, Gated DeltaNet, DSA and MoE
tiny models: longdoc.bench.kinds_memory), gpu (CUDA only: block kernels vs one flash call). The report records the
machine and its load average: timings taken on a loaded machine are flagged as such (memory peaks are not affected by
load).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from longdoc.bench import agreement, attention, calibrate, dsa, kinds_memory, longest, patterns, plots, train_sections
from longdoc.bench import hybrid as hybrid_bench
from longdoc.bench.attention import AttentionBenchConfig
from longdoc.bench.gpu import KernelBenchConfig
from longdoc.bench.runs import TrainRun
from longdoc.bench.sections import SECTIONS
from longdoc.bench.train_sections import Measured, TrainBenchConfig
from longdoc.io import atomic_write, atomic_write_text
from longdoc.plan.hardware import machine_memory_gib

OTHERS_LIMIT = 0.1  # share of the cores other processes may use before timings are flagged as disturbed


@dataclass(kw_only=True)
class SuiteConfig:
    sections: tuple[str, ...] = SECTIONS
    out: str = "runs/bench"
    attention: AttentionBenchConfig = field(default_factory=AttentionBenchConfig)
    attention_lengths: tuple[int, ...] = (4096, 8192, 16384)
    patterns: patterns.PatternBenchConfig = field(default_factory=patterns.PatternBenchConfig)
    agreement: agreement.AgreementBenchConfig = field(default_factory=agreement.AgreementBenchConfig)
    train: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    calibration_runs: tuple[TrainRun, ...] = calibrate.DEFAULT_RUNS
    gpu: KernelBenchConfig = field(default_factory=KernelBenchConfig)
    hybrid: hybrid_bench.HybridBenchConfig = field(default_factory=hybrid_bench.HybridBenchConfig)
    dsa: dsa.DsaBenchConfig = field(default_factory=dsa.DsaBenchConfig)
    kinds: kinds_memory.KindsMemoryConfig = field(default_factory=kinds_memory.KindsMemoryConfig)
    longest: longest.LongestConfig = field(default_factory=longest.LongestConfig)
    resume: bool = False  # longest: measure only the cells missing from <out>/longest.jsonl
    journal_only: bool = False  # longest, with resume: measure nothing, assemble from the journal


def quick() -> SuiteConfig:
    """Small sizes: every section's code path in a few minutes (smoke test, not numbers to publish)."""
    return SuiteConfig(attention=AttentionBenchConfig(repeats=1), attention_lengths=(1024, 2048),
                       patterns=patterns.PatternBenchConfig(seq_len=2048, window=256, packed_len=4096, max_doc=1024,
                                                            rows=2, repeats=1),
                       agreement=agreement.AgreementBenchConfig(seq_len=1024, steps=1, repeats=3),
                       train=train_sections.QUICK, calibration_runs=calibrate.QUICK_RUNS,
                       gpu=KernelBenchConfig(lengths=(4096, 16384), ranks=(2, 4), repeats=2),
                       hybrid=hybrid_bench.HybridBenchConfig(seq_len=1024, repeats=1, layers=4, hidden=64,
                                                             mamba_heads=8, state=16, chunk=32), dsa=dsa.QUICK,
                       kinds=kinds_memory.QUICK, longest=longest.QUICK)


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
    except (OSError, AttributeError):
        pass
    info["memory_gib"] = round(machine_memory_gib(), 1)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped children)."""
    import psutil

    m = psutil.cpu_times()  # idle, iowait and steal (the hypervisor's) are nobody's work here
    t = os.times()
    return (sum(getattr(m, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq")),
            t.user + t.system + t.children_user + t.children_system)


def _others_cores(before: tuple[float, float], wall_s: float) -> float | None:
    """Average cores that processes outside this benchmark used since `before` (the load average cannot
    tell: it counts the benchmark's own ranks)."""
    after = _cpu_seconds()
    if wall_s <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def run(cfg: SuiteConfig, log=print) -> dict:
    """Run the sections, write bench.json, bench.md and the PNGs into cfg.out; return the results."""
    import torch

    unknown = [n for n in cfg.sections if n not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown bench section(s) {unknown}; choose among {', '.join(SECTIONS)}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": machine(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "load_start": _load(), "sections": {}, "plots": []}
    measured: dict[TrainRun, Measured] = {}

    def measure(run: TrainRun) -> Measured:
        # one real run per configuration: the calibration table reuses the other sections' runs
        # (keyed by the threads a rank really gets: threads=None and its resolved value are one run)
        key = dataclasses.replace(run, threads=run.rank_threads)
        if key not in measured:
            measured[key] = train_sections.measure(run, log)
        return measured[key]

    result["others_cores"] = {}
    for name in cfg.sections:
        log(f"[bench] {name}")
        cpu_before, wall_before = _cpu_seconds(), time.perf_counter()
        if name == "attention":
            res = attention.sweep(list(cfg.attention_lengths), cfg.attention, log)
            result["plots"].append(str(plots.attention(res, out)))
            # the pattern rows (window, packed documents, sinks, soft-cap) and the batch agreement's cost
            result["sections"]["attention_patterns"] = patterns.run(cfg.patterns)
            result["sections"]["agreement"] = agreement.run(cfg.agreement)
        elif name == "hybrid":
            res = hybrid_bench.run(cfg.hybrid)
            log(f"  hybrid {cfg.hybrid.seq_len} tokens: E {res['E']:.3f}, peak {res['single_peak_gib']:.2f} -> "
                f"{res['cp_peak_gib']:.2f} GiB")
        elif name == "train":
            res = [m.to_dict() for m in train_sections.throughput(cfg.train, measure)]
            result["plots"].append(str(plots.throughput(res, out)))
        elif name == "memory":
            res = train_sections.memory_vs_cp(cfg.train, measure)
            result["plots"].append(str(plots.memory(res, out)))
        elif name == "longest":
            res = longest.run(cfg.longest, out, log, resume=cfg.resume, journal_only=cfg.journal_only) | {
                "machine": result["machine"]}
            result["plots"].append(str(plots.longest_matrix(res, out)))
            atomic_write_text(out / "longest.json", json.dumps(res, indent=1) + "\n")
            atomic_write_text(out / "longest.md", longest.to_markdown(res) + "\n")
        elif name == "calibration":
            for r in cfg.calibration_runs:
                measure(r)
            res = [_calibration_row(m) for m in measured.values()]
            calibrated = [r for r in res if r["calibrated"]] or res
            result["plots"].append(str(plots.calibration(calibrated, out, calibrate.TOLERANCE)))
        elif name == "dsa":
            res = dsa.run(cfg.dsa)
        elif name == "kinds":
            res = kinds_memory.run(cfg.kinds, log)
            ratios = [f"{r['model']} {r['ratios']['peak']:.2f}x, {r['ratios']['rss_growth']:.2f}x" for r in res["rows"]]
            log(f"  kinds at {cfg.kinds.seq_len} tokens, cp={cfg.kinds.ranks} / one process (tracked, RSS): "
                + "; ".join(ratios))
        elif name == "gpu":
            if not torch.cuda.is_available():
                log("  skipped: no CUDA device")
                continue
            from longdoc.bench import gpu

            res = gpu.run(cfg.gpu, log)
            result["plots"].append(str(plots.kernels(res, out)))
        result["sections"][name] = res
        result["others_cores"][name] = _others_cores(cpu_before, time.perf_counter() - wall_before)
    result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["load_end"] = _load()
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "bench.md").write_text(to_markdown(result) + "\n")
    return result


def _calibration_row(m: Measured) -> dict:
    err = m.predicted_gib / m.peak_gib - 1
    return {"run": m.run.label(), "predicted_gib": m.predicted_gib, "measured_gib": m.peak_gib, "error": err,
            "within_tolerance": abs(err) <= calibrate.TOLERANCE, "calibrated": m.run.release_memory,
            "run_config": asdict(m.run)}


def to_markdown(result: dict) -> str:
    from longdoc.bench import gpu

    m = result["machine"]
    cpus = m.get("cpus") or 1
    others = {k: v for k, v in (result.get("others_cores") or {}).items() if v is not None}
    lines = [f"Machine: {m.get('cpu')}, {cpus} cores, {m.get('memory_gib', '?')} GiB"
             + (f", {m['gpu']}" if m.get("gpu") else "") + f"; torch {m['torch']}, Python {m['python']}. "
             f"Run {result['started']} to {result.get('finished', '?')}, load average "
             f"{result.get('load_start', -1):.1f} at start, {result.get('load_end', -1):.1f} at the end."]
    busy = [f"{k} ({v:.2f} cores)" for k, v in others.items() if v > OTHERS_LIMIT * cpus]
    if others and not busy:
        lines += ["", f"Nothing else ran: other processes used under {OTHERS_LIMIT:.0%} of the cores in every section "
                      "(" + ", ".join(f"{k} {v:.2f}" for k, v in others.items()) + " cores on average)."]
    elif busy or (not others and result.get("load_start", 0) > 0.5 * cpus):
        where = "during " + ", ".join(busy) if busy else f"(load average {result['load_start']:.1f} at start)"
        lines += ["", f"**Other processes used the CPU {where}**: times, tokens/s, E and Z there are disturbed; "
                      "memory peaks are not."]
    s = result["sections"]
    if "attention" in s:
        lines += ["", "#### Attention: CP efficiency, zigzag vs contiguous, ring vs all-gather", "",
                  attention.sweep_markdown(s["attention"])]
    if "attention_patterns" in s:
        lines += ["", "#### Attention patterns: sliding window, packed documents, sinks, soft-capping", "",
                  patterns.to_markdown(s["attention_patterns"])]
    if "agreement" in s:
        lines += ["", "#### Batch content agreement", "", agreement.to_markdown(s["agreement"])]
    if "hybrid" in s:
        lines += ["", "#### Hybrid model (Mamba2 + attention): CP vs one process, state exchange vs ring", "",
                  hybrid_bench.to_markdown(s["hybrid"])]
    if "train" in s:
        rows = [_from_dict(r) for r in s["train"]]
        lines += ["", "#### Training step: cp=1 vs cp=2 at equal total cores", "",
                  train_sections.throughput_markdown(rows)]
    if "memory" in s:
        lines += ["", "#### Peak memory per rank vs cp", "", train_sections.memory_markdown(s["memory"])]
    if "longest" in s:
        lines += ["", "#### Longest sequence under a per-process memory cap", "", longest.to_markdown(s["longest"])]
    if "calibration" in s:
        rows = [r for r in s["calibration"] if r.get("calibrated", True)]
        raw = [r for r in s["calibration"] if not r.get("calibrated", True)]
        ok = sum(r["within_tolerance"] for r in rows)
        lines += ["", f"#### Planner vs measured peak memory ({ok} of {len(rows)} runs within "
                      f"{calibrate.TOLERANCE:.0%})", "",
                  "Peak RSS over each rank's whole life (largest rank), ranks returning freed memory to the OS "
                  "(`longdoc.train.metrics.return_freed_memory`).", "",
                  "| run | precision | planner GiB | measured peak RSS GiB | error |", "|---|---|---:|---:|---:|"]
        # the planner predicts each run in the precision its recipe pinned (TrainRun.precision)
        lines += [f"| {r['run']} | {r.get('run_config', {}).get('precision', '?')} | {r['predicted_gib']:.3f} | "
                  f"{r['measured_gib']:.3f} | {r['error']:+.1%} |" for r in rows]
        if raw:
            lines += ["", "With glibc's default allocator (train.release_freed_memory=false) the processes hold freed "
                          "memory: "
                          + "; ".join(f"{r['run']}: {r['measured_gib']:.2f} GiB measured vs {r['predicted_gib']:.2f} "
                                      f"planned" for r in raw) + "."]
    if "dsa" in s:
        lines += ["", "#### Sparse indexed attention (DeepSeek DSA): one process vs CP, DSA vs dense causal", "",
                  dsa.to_markdown(s["dsa"])]
    if "kinds" in s:
        lines += ["", "#### Per-rank activation memory by layer kind: CP vs one process", "",
                  kinds_memory.to_markdown(s["kinds"])]
    if "gpu" in s:
        lines += ["", "#### CUDA block kernels", "", gpu.to_markdown(s["gpu"])]
    if result.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"`{Path(p).name}`" for p in result["plots"])]
    return "\n".join(lines)


def _from_dict(d: dict) -> Measured:
    run = TrainRun(model=d["model"], cp=d["cp"], seq_len=d["seq_len"], checkpointing=d["checkpointing"],
                   lora=d["lora"], threads=d["threads_per_rank"])
    return Measured(run=run, peak_gib=d["peak_gib"], predicted_gib=d["predicted_gib"],
                    tokens_per_s=d["tokens_per_s"], step_s=d["step_s"], rank_peaks_gib=d["rank_peaks_gib"])


def publish(result: dict, dest: str | Path) -> list[Path]:
    """Copy a full run's bench.json and plots into `dest` (docs/bench in a checkout: the performance page, its
    plots and the README's headline numbers are generated from that folder, never typed). Each file is replaced
    atomically; files of `dest` the run did not write (another section's json, an older plot) are kept."""
    dest = Path(dest)
    written = []
    plots_out = []
    for src in map(Path, result.get("plots", [])):
        target = dest / src.name
        written.append(atomic_write(target, lambda tmp, src=src: shutil.copyfile(src, tmp)))
        plots_out.append(str(target))
    record = {**result, "plots": plots_out}
    written.append(atomic_write_text(dest / "bench.json", json.dumps(record, indent=2, default=str) + "\n"))
    return written
