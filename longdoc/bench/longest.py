"""`longdoc bench longest`: the longest trainable sequence under a per-process memory cap, for each model, cp and
memory feature, on this machine's CPU ranks.

    longdoc bench longest                                    # 4 GiB; 135M full FT and LoRA, a hybrid; cp 1, 2, 4
    longdoc bench longest --models 135m --cp 2,4 --features baseline,all --cap-gib 4
    longdoc bench longest --resume                           # go on from the cells already in <out>/longest.jsonl
    longdoc bench longest --quick                            # small probes at cp=2 (a smoke run)

Training the full depth at these lengths takes hours per run on two cores, so every cell has two parts, labelled
apart in the JSON ("measured", "planner") and in the tables:
  measured  real training steps (the trainer itself, `runs.run_steps`: fresh gloo ranks, random tokens, 2 steps so
            the AdamW moments exist) of the model at reduced depth (--layers, default 1; the hybrid at least 2: one
            Mamba2 and one attention layer), at a probe length of --probe tokens per rank (the same work per rank at
            every cp), halved while the planner puts the run above 80% of the cap; the largest rank's lifetime
            peak RSS, next to the planner's prediction of the same run (error flagged beyond 5%);
  planner   the longest sequence (a multiple of 1,024) whose predicted peak at the model's full depth (30 layers)
            stays under the cap: the per-token and per-layer terms the probe checks, carried to full depth.
Features: baseline (DDP replicas, untiled MLP), + FSDP (weights, gradients and AdamW moments sharded over the ranks),
+ tiled MLP, all on; a combination the planner refuses (FSDP with LoRA) is left out with its reason, as is a cell
that would repeat another's run. The checkpoint offload moves nothing on a CPU (the host is the device): it is left
out of the default features with the planner's check stated (`--features all,offload` measures it anyway).
Each finished cell is one line of <out>/longest.jsonl, rewritten atomically, with the `uptime` load before and after
it: a killed run loses no finished cell, and --resume measures only the missing ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from longdoc.bench.calibrate import predict, run_shape
from longdoc.bench.runs import MODELS as RUN_MODELS
from longdoc.bench.runs import RunResult, TrainRun, run_steps
from longdoc.bench.sections import LONGEST_DEFAULT_FEATURES as DEFAULT_FEATURES
from longdoc.bench.sections import LONGEST_FEATURES as FEATURES
from longdoc.bench.sections import LONGEST_MODELS as MODELS
from longdoc.io import atomic_write_text
from longdoc.plan.hardware import Precision, cpu_precision
from longdoc.plan.planner import PlanRequest
from longdoc.runtime.budgets import loss_chunk_tokens

TOLERANCE = 0.05  # issue 28: the planner within 5% of every measured CPU peak
PROBE_SHARE = 0.8  # a probe's predicted peak stays under this share of the cap
MIN_PROBE = 256  # tokens per rank: the shortest probe before a cell is given up
STEP = 1024  # the planner's longest lengths are multiples of this
JOURNAL = "longest.jsonl"


@dataclass(frozen=True, kw_only=True)
class LongestConfig:
    cap_gib: float = 4.0
    cps: tuple[int, ...] = (1, 2, 4)
    models: tuple[str, ...] = tuple(MODELS)
    features: tuple[str, ...] = DEFAULT_FEATURES
    layers: int = 1  # decoder layers of the measured runs (the hybrid: at least 2)
    probe: int = 8192  # tokens per rank of a measured run, before the cap lowers it
    steps: int = 2
    precision: Precision = field(default_factory=cpu_precision)

    def __post_init__(self):
        for name, given, known in (("models", self.models, MODELS), ("features", self.features, FEATURES)):
            unknown = [x for x in given if x not in known]
            if unknown or not given:
                raise ValueError(f"longest: {name} must be among {', '.join(known)}, got {', '.join(given) or 'none'}")
        if not self.cps or min(self.cps) < 1:
            raise ValueError(f"longest: cp sizes must be positive, got {self.cps}")
        if self.layers < 1 or self.probe < MIN_PROBE or self.steps < 1 or self.cap_gib <= 0:
            raise ValueError(f"longest: layers >= 1, probe >= {MIN_PROBE} tokens per rank, steps >= 1 and a positive "
                             f"cap are needed, got layers={self.layers}, probe={self.probe}, steps={self.steps}, "
                             f"cap_gib={self.cap_gib}")


QUICK = LongestConfig(cps=(2,), features=("all",), probe=512)  # one run per model (a smoke run)


@dataclass(frozen=True)
class Cell:
    """One (model, cp, feature) of the matrix: the run to measure, or None with the reason it is left out."""

    model: str
    cp: int
    feature: str
    run: TrainRun | None
    note: str = ""  # why it is left out, or how its probe or features were adjusted


def _refusal(run: TrainRun) -> str | None:
    """The planner's refusal of the run's feature combination (its request check), or None."""
    try:
        PlanRequest(model=RUN_MODELS[run.model], seq_len=run.seq_len, gpus=run.cp, cp=run.cp, gpu="cpu",
                    lora=run.lora, fsdp=run.fsdp, tiled_mlp=run.tiled_mlp, offload=run.offload,
                    checkpointing=run.checkpointing, precision=run.precision)
    except ValueError as e:
        return str(e)
    return None


def _probe(run: TrainRun, cfg: LongestConfig) -> tuple[TrainRun | None, str]:
    """The run at cfg.probe tokens per rank, halved while the planner puts it above PROBE_SHARE of the cap."""
    per_rank = cfg.probe
    while True:
        probe = dataclasses.replace(run, seq_len=per_rank * run.cp)
        gib = predict(probe).total_gib
        if gib <= PROBE_SHARE * cfg.cap_gib:
            note = "" if per_rank == cfg.probe else (f"probe lowered to {per_rank:,} tokens per rank (the planner puts "
                                                     f"{cfg.probe:,} above {PROBE_SHARE:.0%} of the cap)")
            return probe, note
        if per_rank // 2 < MIN_PROBE:
            return None, (f"left out: the planner puts even {per_rank:,} tokens per rank at {gib:.2f} GiB, above "
                          f"{PROBE_SHARE:.0%} of the {cfg.cap_gib:g} GiB cap")
        per_rank //= 2


def plan_cells(cfg: LongestConfig) -> list[Cell]:
    """Every (model, cp, feature) of cfg, with its probe run or the reason it is left out."""
    cells = []
    for model in cfg.models:
        _, run_model, lora = MODELS[model]
        layers = max(cfg.layers, 2) if run_model == "hybrid" else cfg.layers
        for cp in cfg.cps:
            base = TrainRun(model=run_model, cp=cp, lora=lora, layers=layers, steps=cfg.steps, precision=cfg.precision)
            # the loss chunk as `longdoc train` sizes it from the vocabulary
            base = dataclasses.replace(base, loss_chunk=loss_chunk_tokens(run_shape(base).vocab))
            planned: dict[TrainRun, str] = {}
            for feature in cfg.features:
                run = dataclasses.replace(base, **FEATURES[feature][1])
                note = ""
                refused = _refusal(run)
                if refused and feature in ("all", "offload") and run.fsdp:  # all on: every feature the model takes
                    why = "" if "fsdp" in cfg.features else f" ({refused})"  # else the + FSDP row states it
                    run, note = dataclasses.replace(run, fsdp=False), f"without FSDP, which the planner refuses{why}"
                    refused = _refusal(run)
                if refused:
                    cells.append(Cell(model, cp, feature, None, f"left out: the planner refuses it ({refused})"))
                    continue
                probe, probe_note = _probe(run, cfg)
                note = "; ".join(n for n in (note, probe_note) if n)
                if probe is not None and probe in planned:
                    probe, note = None, f"left out: the same run as '{FEATURES[planned[probe]][0]}' ({note})"
                if probe is not None:
                    planned[probe] = feature
                cells.append(Cell(model, cp, feature, probe, note))
    return cells


def planner_longest(run: TrainRun, cap_gib: float, step: int = STEP, ceiling: int = 1 << 22) -> int:
    """The longest seq_len (a multiple of `step`, at most `ceiling`) whose predicted peak for `run` fits the cap;
    0 when not even `step` tokens fit."""
    def fits(n: int) -> bool:
        return predict(dataclasses.replace(run, seq_len=n)).total_gib <= cap_gib

    lo, hi = 0, step
    while fits(hi):
        if hi >= ceiling:
            return ceiling
        lo, hi = hi, min(2 * hi, ceiling)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def planner_part(run: TrainRun, cap_gib: float) -> dict:
    """The planner's side of a cell: the probe run's predicted peak, and the longest under the cap at full depth."""
    est = predict(run)
    # a training run, not the probe's 2 steps: from the third step on DDP's rebuilt gradient buckets are resident
    full = dataclasses.replace(run, layers=None, steps=max(run.steps, 3))
    return {"probe_gib": est.total_gib, "peak_phase": est.peak_phase, "full_layers": run_shape(full).layers,
            "longest_full_depth": planner_longest(full, cap_gib), "notes": est.notes}


def _uptime() -> dict:
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        line = ""
    return {"uptime": line, "load": [round(x, 2) for x in os.getloadavg()]}


Measure = Callable[[TrainRun], RunResult]


def measure_cell(cell: Cell, cap_gib: float, measure: Measure = run_steps, log=print) -> dict:
    """One cell's record: measured (or the failure's last line), the planner's part, the load around the run."""
    rec: dict = {"model": cell.model, "cp": cell.cp, "feature": cell.feature, "note": cell.note}
    if cell.run is None:
        return rec | {"status": "skipped"}
    rec["run"] = asdict(cell.run) | {"label": cell.run.label()}
    rec["before"], start = _uptime(), time.perf_counter()
    try:
        res = measure(cell.run)
    except Exception as e:  # noqa: BLE001 - a failed cell is recorded with its reason; the matrix goes on
        lines = [x for x in str(e).strip().splitlines() if x.strip()]
        rec |= {"status": "failed", "error": (lines[-1] if lines else type(e).__name__)[:500]}
    else:
        rec |= {"status": "measured", "measured": {
            "peak_gib": res.peak_gib, "rank_peaks_gib": res.rank_peaks_gib, "step_peaks_gib": res.step_peaks_gib,
            "step_s": res.step_s, "tokens_per_s": res.tokens_per_s}}
    rec["wall_s"], rec["after"] = time.perf_counter() - start, _uptime()
    return _with_planner(rec, cell.run, cap_gib, log)


def _with_planner(rec: dict, run: TrainRun, cap_gib: float, log) -> dict:
    rec = rec | {"planner": planner_part(run, cap_gib)}
    p = rec["planner"]
    if rec["status"] == "measured":
        error = p["probe_gib"] / rec["measured"]["peak_gib"] - 1
        rec["planner"] |= {"error": error, "within_tolerance": abs(error) <= TOLERANCE}
        log(f"  {run.label():<34} measured {rec['measured']['peak_gib']:.3f} GiB, planner {p['probe_gib']:.3f} "
            f"({error:+.1%}); planner's longest at {p['full_layers']} layers {p['longest_full_depth']:,} tokens")
    else:
        log(f"  {run.label():<34} failed: {rec['error']}")
    return rec


def _journal(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # not a finished record
    return out


def _commit() -> str | None:
    """The checkout's commit ("-dirty" with uncommitted changes): the planner's numbers are this code's."""
    try:
        head = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() or None


def _key(run: dict) -> str:
    return json.dumps({k: v for k, v in run.items() if k != "label"}, sort_keys=True)


def run(cfg: LongestConfig, out: str | Path, log=print, resume: bool = False, measure: Measure = run_steps,
        journal_only: bool = False) -> dict:
    """Measure every cell of cfg (with resume, not those already measured in <out>/longest.jsonl) and return the
    matrix; the journal is rewritten after each cell. journal_only (with resume): measure nothing, a cell missing
    from the journal is shown as not measured (a matrix assembled from several partial runs)."""
    if journal_only and not resume:
        raise ValueError("longest: --journal-only assembles the matrix from <out>/longest.jsonl; it needs --resume")
    journal = Path(out) / JOURNAL
    cells = plan_cells(cfg)
    runs = [c.run for c in cells if c.run is not None]
    planned = {_key(asdict(r)) for r in runs}
    old = [r for r in _journal(journal) if r.get("status") == "measured"] if resume else []
    done = {_key(r["run"]): r for r in old}
    keep = [r for r in old if _key(r["run"]) not in planned]  # other cells measured before stay in the journal
    started = datetime.datetime.now().isoformat(timespec="seconds")
    log(f"  {len(cells)} cells, {len(runs)} runs" + (f", {len(planned & set(done))} of them measured before"
                                                     if resume else ""))
    records: list[dict] = []
    for cell in cells:
        prev = done.get(_key(asdict(cell.run))) if cell.run is not None else None
        if prev is not None:  # measured before: the planner's part is this checkout's planner's
            rec = _with_planner({k: v for k, v in prev.items() if k != "planner"} | {"note": cell.note}, cell.run,
                                cfg.cap_gib, log)
        elif journal_only and cell.run is not None:
            rec = {"model": cell.model, "cp": cell.cp, "feature": cell.feature, "status": "skipped",
                   "note": "left out: not measured (the matrix was assembled from the runs in the journal)"}
        else:
            rec = measure_cell(cell, cfg.cap_gib, measure, log)
        records.append(rec)
        atomic_write_text(journal, "".join(json.dumps(r) + "\n" for r in keep + records))
    offload_moves = any(predict(dataclasses.replace(r, offload=True)).total != predict(r).total for r in runs)
    return {"kind": "longest-matrix", "config": asdict(cfg), "tolerance": TOLERANCE, "probe_share": PROBE_SHARE,
            "started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": _commit(), "offload_moves_memory": offload_moves, "cells": records}


def _on(run: dict) -> str:
    on = [name for key, name in (("fsdp", "FSDP"), ("tiled_mlp", "tiled MLP"), ("offload", "offload")) if run.get(key)]
    return " + ".join(on) or "none (DDP)"


def _tokens(n: int) -> str:
    return f"{n / 1024:,.0f}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def _row(rec: dict, baseline: int | None) -> str:
    run, p = rec["run"], rec["planner"]
    probe = f"{_tokens(run['seq_len'])} ({run['layers']} layer{'s' * (run['layers'] > 1)})"
    if rec["status"] == "measured":
        err = f"{p['error']:+.1%}"
        measured = f"{rec['measured']['peak_gib']:.3f} | {p['probe_gib']:.3f} | " + \
            (err if p["within_tolerance"] else f"**{err}**")
    else:
        measured = f"failed: {rec['error'][:120]} | {p['probe_gib']:.3f} | -"
    longest = p["longest_full_depth"]
    gain = f"{longest / baseline:.2f}x" if baseline and rec["feature"] != "baseline" else "-"
    return f"| {rec['cp']} | {_on(run)} | {probe} | {measured} | {longest:,} | {gain} |"


def summary(res: dict) -> list[str]:
    """Per model: the planner's longest at full depth with the best features, per cp (the matrix's headline)."""
    lines = []
    for model in res["config"]["models"]:
        best: dict[int, dict] = {}
        for r in res["cells"]:
            if r["model"] == model and "planner" in r and r["status"] == "measured":
                if r["cp"] not in best or r["planner"]["longest_full_depth"] > \
                        best[r["cp"]]["planner"]["longest_full_depth"]:
                    best[r["cp"]] = r
        if best:
            per = ", ".join(f"cp={cp} {r['planner']['longest_full_depth']:,} tokens ({_on(r['run'])})"
                            for cp, r in sorted(best.items()))
            lines.append(f"- {MODELS[model][0]}: {per}")
    return lines


def to_markdown(res: dict) -> str:
    """The matrix as tables, one per model, with what is measured and what is the planner's named apart (or a
    `longest` section as the suite published it before the matrix, 2026-12-01)."""
    if res.get("kind") != "longest-matrix":
        return _legacy_markdown(res)
    c, cells = res["config"], res["cells"]
    loads = [x for r in cells for x in (r.get("before", {}).get("load", [None])[0],
                                        r.get("after", {}).get("load", [None])[0]) if x is not None]
    measured = [r for r in cells if r["status"] == "measured"]
    flagged = [r for r in measured if not r["planner"]["within_tolerance"]]
    full = next((r["planner"]["full_layers"] for r in cells if "planner" in r), 30)
    m = res.get("machine") or {}
    lines = [
        f"{res['started'][:10]}" + (f", commit {res['commit']}" if res.get("commit") else "") +
        (f", {m.get('cpus')} cores ({m.get('cpu')})" if m else "") + f"; {c['precision']}; per-process cap "
        f"{c['cap_gib']:g} GiB. **Measured**: {c['steps']} training steps of the trainer (fresh gloo ranks, random "
        f"tokens) at reduced depth, at a probe of {c['probe']:,} tokens per rank (halved where the planner puts it "
        f"above {res['probe_share']:.0%} of the cap): the largest rank's lifetime peak RSS. **Planner**: `longdoc "
        f"plan`'s memory model of the same run (error = planner / measured - 1, bold beyond "
        f"{res['tolerance']:.0%}), and the longest sequence (a multiple of {STEP:,}) under the cap at full depth "
        f"({full} layers), its per-layer and per-token terms carried from the probe's depth. Load average (1 min) "
        + (f"{min(loads):.2f} to {max(loads):.2f} around the runs." if loads else "not recorded."), ""]
    lines += ["The planner's longest at full depth, best features per cp:", "", *summary(res)]
    for model in c["models"]:
        rows = [r for r in cells if r["model"] == model]
        base = {r["cp"]: r["planner"]["longest_full_depth"] for r in rows
                if r["feature"] == "baseline" and "planner" in r}
        lines += ["", f"#### {MODELS[model][0]}", "",
                  f"| cp | features on | probe tokens (depth) | measured: peak GiB per rank | planner: same run GiB | "
                  f"planner error | planner: longest at {full} layers | vs baseline |",
                  "|---:|---|---|---:|---:|---:|---:|---:|"]
        lines += [_row(r, base.get(r["cp"])) for r in rows if "run" in r]
        notes = [f"cp={r['cp']} {FEATURES[r['feature']][0]}: {r['note']}" for r in rows if r["note"]]
        planner_notes = dict.fromkeys(n for r in rows if "planner" in r for n in r["planner"]["notes"])
        lines += [""] * bool(notes or planner_notes) + [f"- {n}" for n in notes] + \
            [f"- planner: {n}" for n in planner_notes]
    offload = ("measured as a feature of its own" if "offload" in c["features"] else "left out of the features")
    lines += ["", f"{len(measured)} runs measured, {len(flagged)} with the planner beyond {res['tolerance']:.0%}"
              + (": " + ", ".join(r["run"]["label"] for r in flagged) if flagged else "") + ". Checkpoint offload: "
              + offload + ("; on this CPU the planner's estimate of every run is the same with and without it (the "
                           "host is the device: nothing moves)" if not res["offload_moves_memory"] else
                           "; the planner's estimate changes with it")
              + "."]
    return "\n".join(lines)


def _legacy_markdown(result: dict) -> str:
    lines = [f"Per-process cap {result['cap_gib']} GiB, {result['run'].split(' cp')[0]} model, steps of "
             f"{result['step']:,} tokens", "", "| cp | longest measured | planner's longest | probes (tokens: GiB) |",
             "|---:|---:|---:|---|"]
    for r in result["rows"]:
        probes = ", ".join(f"{p['seq_len'] // 1024}k: {p['peak_gib']:.2f}" for p in r["probes"])
        lines.append(f"| {r['cp']} | {r['measured_longest']:,} | {r['predicted_longest']:,} | {probes} |")
    return "\n".join(lines)
