"""The evaluation tasks by name, and the jobs that run them on CP ranks (see longdoc.eval.runner).

A task module has `check(cfg)`, `task(model, tokenizer, cp, cfg) -> result` and
`write_report(run_dir, result)`. `run_and_report` runs one task on one model; `run_suite` runs several
tasks on several models in ONE start of the ranks (each model loaded once), for `eval compare`.
"""

from __future__ import annotations

import gc
import importlib
import re
import sys
import time
from pathlib import Path
from typing import Any

from longdoc.eval import report, runner

TASKS = {"qa": "longdoc.eval.qa", "needle": "longdoc.eval.needle", "position-loss": "longdoc.eval.position",
         "ruler": "longdoc.eval.ruler.run", "chat-loss": "longdoc.eval.chat_loss"}


def module(name: str):
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return importlib.import_module(TASKS[name])


def single(cp, device, cfg: dict[str, Any]) -> dict[str, Any]:
    """Job: cfg["task"] on cfg["model"]."""
    started = time.time()
    model, tokenizer = runner.load_model(cfg["model"], cfg, device)
    return runner.stamp(module(cfg["task"]).task(model, tokenizer, cp, cfg), cfg, cp.size, started)


def suite(cp, device, cfg: dict[str, Any]) -> dict[str, Any]:
    """Job: the tasks of each (name, model, overrides, tasks) of cfg["suite_models"]."""
    out: dict[str, Any] = {}
    for name, model_name, overrides, wanted in cfg["suite_models"]:
        model, tokenizer = runner.load_model(model_name, cfg, device)
        out[name] = {}
        for t in wanted:
            started = time.time()
            task_cfg = {**cfg, **overrides.get(t, {}), "model": model_name, "task": t}
            for key in ("suite_models", "suite_tasks"):
                task_cfg.pop(key, None)
            out[name][t] = runner.stamp(module(t).task(model, tokenizer, cp, task_cfg), task_cfg, cp.size, started)
        del model
        gc.collect()
    return out


def run_and_report(name: str, cfg: dict[str, Any], run_dir: str | Path | None = None) -> Path | None:
    """Run task `name` on cfg["model"] with cfg["cp"] ranks; returns the run folder in the process that
    wrote it (rank 0 or the spawning parent), None on other ranks."""
    mod = module(name)
    cfg = {**cfg, "task": name}
    mod.check(cfg)  # before any rank starts: bad input fails here, once, with a clear message
    result = runner.run(single, cfg)
    if result is None:
        return None
    run_dir = Path(run_dir or cfg.get("out") or report.default_run_dir(name, cfg["model"]))
    mod.write_report(run_dir, result)
    return run_dir


def run_suite(models: list[tuple[str, str]], names: list[str], cfg: dict[str, Any], out: Path,
              overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Path]] | None:
    """Run tasks `names` on each (label, model) and write out/<label>/<task>/ run folders; returns
    label -> task -> folder where the folders were written, None on other ranks. A (model, task) whose result
    is in the content cache (longdoc.eval.cache) is not run again; a model with every task cached starts no
    ranks."""
    from longdoc.eval import cache
    from longdoc.runtime.launch import launched_world

    overrides = overrides or {}
    for t in names:
        module(t).check({**cfg, **overrides.get(t, {})})
    use_cache = cfg.get("cache", True) and launched_world().world_size == 1  # the parent decides for every rank
    folder = Path(cfg.get("cache_dir") or cache.default_dir())
    keys = {(label, t): cache.key(m, {**cfg, **overrides.get(t, {}), "task": t}) if use_cache else None
            for label, m in models for t in names}
    results: dict[str, dict[str, Any]] = {label: {} for label, _ in models}
    for (label, t), k in keys.items():
        hit = cache.load(folder, k)
        if hit is not None:
            results[label][t] = hit
            print(f"{label}: {t} results reused from the cache ({folder / k}.json)", file=sys.stderr, flush=True)
    todo = [(n, m, overrides, [t for t in names if t not in results[n]]) for n, m in models]
    todo = [entry for entry in todo if entry[3]]
    if todo:
        ran = runner.run(suite, {**cfg, "suite_tasks": list(names), "suite_models": todo})
        if ran is None:
            return None
        for label, per_task in ran.items():
            for t, result in per_task.items():
                results[label][t] = result
                cache.store(folder, keys[(label, t)], result)
    folders: dict[str, dict[str, Path]] = {}
    for label, per_task in results.items():
        for t in names:
            path = out / (re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "model") / t
            folders.setdefault(label, {})[t] = module(t).write_report(path, per_task[t])
    return folders
