"""Run an evaluation task on N context-parallel ranks and hand rank 0's result back.

Two ways to get N ranks, chosen by `run`:
  - under a launcher (`accelerate launch` / `torchrun`: WORLD_SIZE is set, or torch.distributed is
    already initialized): this process is one rank; the whole world is the CP group and must equal
    --cp. GPUs are used when present (NCCL), CPUs otherwise (gloo).
  - otherwise, with --cp N > 1: N local gloo ranks are spawned on this machine (longdoc.runtime.spawn), each
    loading the model on CPU; the calling process waits and gets rank 0's result.

A job is a module-level function `fn(cp, device, cfg) -> dict` (picklable for spawning; see
longdoc.eval.tasks); every rank runs it with the same cfg and must make the same calls. Results are
plain JSON-ready data.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from typing import Any

Job = Callable[..., dict[str, Any]]

# --dtype spellings accepted on the command line -> the torch dtype's name
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float16": "float16", "fp16": "float16"}


def check_dtype(name: str) -> str:
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of {', '.join(sorted(set(_DTYPE_ALIASES)))}, got {name!r}")
    return _DTYPE_ALIASES[name]


def device_for(cfg: dict[str, Any], launched: bool):
    """The torch device a rank evaluates on: cfg["device"], where "auto" is this rank's GPU under a launcher when
    CUDA is available, else the CPU."""
    import torch

    want = cfg.get("device", "auto")
    if want == "cuda" or (want == "auto" and launched and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but CUDA is not available; use --device cpu")
        from longdoc.runtime.launch import launched_world

        local = launched_world().local_rank
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def load_model(name: str, cfg: dict[str, Any], device) -> tuple[Any, Any]:
    """(model in eval mode on `device`, tokenizer) for a model name, folder or "tiny:<arch>"; RoPE extended
    by --rope-type/--rope-factor through training's own loader, so both extend it the same way."""
    from longdoc.train.config import ModelConfig
    from longdoc.train.modeling import load_extended

    mcfg = ModelConfig(name=name, dtype=check_dtype(cfg.get("dtype", "float32")), rope_type=cfg.get("rope_type"),
                       rope_factor=float(cfg.get("rope_factor") or 1.0))
    model, tokenizer = load_extended(mcfg)
    return model.to(device).eval(), tokenizer


def check_context(model: Any, tokens: int, what: str) -> None:
    """Refuse, before any compute, `tokens` positions past the model's context (training's rule and code)."""
    from longdoc.train.modeling import check_context as check
    from longdoc.train.modeling import context_limit

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in (None, "default"):
        extend = ("--rope-type yarn --rope-factor {factor} (the model has no RoPE scaling; this extends it as "
                  "training's model.rope_type / model.rope_factor do), or use a model fine-tuned with RoPE scaling")
    else:  # scaling does not stack (training refuses it too)
        extend = f"a model fine-tuned for a longer context (this one already has {rope} RoPE scaling)"
    check(tokens, context_limit(model), what=what, extend=extend,
          shorten="use shorter documents")


def check_model(cfg: dict[str, Any]) -> None:
    """Before any rank starts or any weights load: the model name resolves (from its config alone), and the lengths
    asked for fit its context (the ranks check every prompt again, exactly, once tokenized)."""
    from longdoc.train.config import ModelConfig
    from longdoc.train.modeling import check_context
    from longdoc.train.preflight import model_context

    mcfg = ModelConfig(name=cfg["model"], rope_type=cfg.get("rope_type"),
                       rope_factor=float(cfg.get("rope_factor") or 1.0))
    limit = model_context(mcfg)
    task, lengths, new = cfg.get("task"), cfg.get("lengths") or [], int(cfg.get("max_new_tokens") or 0)
    asked = {"needle": (max(lengths, default=0) + new, f"--lengths {max(lengths, default=0)} plus --max-new-tokens "
                                                       f"{new}"),
             "ruler": (max(lengths, default=0), f"--lengths {max(lengths, default=0)}"),
             "position-loss": (int(cfg.get("length") or 0), f"--length {cfg.get('length')}")}.get(task)
    if asked and asked[0]:
        extend = "--rope-type yarn --rope-factor {factor}" if mcfg.rope_type is None else "a larger --rope-factor"
        check_context(asked[0], limit, what=asked[1], extend=extend, shorten="ask for shorter lengths")


def stamp(result: dict[str, Any], cfg: dict[str, Any], cp_size: int, started: float) -> dict[str, Any]:
    """Add the run's settings and timing to a task result."""
    result.setdefault("model", cfg.get("model"))
    result["config"] = {**cfg, "cp": cp_size}
    result["seconds"] = time.time() - started
    result["finished"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return result


def run_rank(fn: Job, cfg: dict[str, Any], launched: bool = False) -> dict[str, Any]:
    """One rank: build the CP group over the world, pick the device, run `fn(cp, device, cfg)`."""
    import longdoc

    device = device_for(cfg, launched)
    cp = longdoc.ContextParallel(layout=cfg.get("layout", "zigzag"), timeout=cfg.get("timeout", 1800),
                                 ulysses_size=cfg.get("ulysses_size"))
    return fn(cp, device, cfg)


class EvalInputError(ValueError):
    """Bad input found on the ranks (the same on every rank, before any collective); the message says the fix."""


def _spawned(rank: int, world_size: int, fn: Job, cfg: dict[str, Any]) -> dict[str, Any] | None:
    result = run_rank(fn, cfg)
    return result if rank == 0 else None  # only rank 0's copy travels back


def run(fn: Job, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Run `fn(cp, device, cfg)` on cfg["cp"] ranks. Returns the result in the process that should write the report
    (rank 0, or the parent of spawned ranks) and None elsewhere."""
    cp_size = int(cfg.get("cp", 1))
    if cp_size < 1:
        raise ValueError(f"--cp must be >= 1, got {cp_size}")
    from longdoc.runtime.launch import launched_world, process_group

    if (launch := launched_world()).launched:
        world = launch.world_size
        if world != cp_size:
            raise ValueError(f"launched with {world} processes but --cp {cp_size}: evaluation uses the whole world "
                             f"as one CP group; pass --cp {world} (or launch {cp_size} processes)")
        backend = "gloo" if cfg.get("device", "auto") == "cpu" else None  # None: nccl on CUDA, else gloo
        with process_group(backend, timeout=cfg.get("timeout", 1800)) as joined:
            result = run_rank(fn, cfg, launched=True)
            return result if joined.is_main else None
    if cp_size == 1:
        return run_rank(fn, cfg)
    from longdoc.errors import USER_ERRORS
    from longdoc.runtime.spawn import run_local

    threads = int(cfg.get("threads") or max(1, (os.cpu_count() or 1) // cp_size))
    # The deadline bounds the whole run; collectives keep their own timeout (cfg["timeout"]).
    # Bad input raised on the ranks (every rank alike, before any collective) comes back as the same exception,
    # so the parent prints the one line a single process prints.
    return run_local(cp_size, _spawned, fn, cfg, threads=threads, deadline=float(cfg.get("deadline", 7 * 86400)),
                     pg_timeout=float(cfg.get("timeout", 1800)), input_errors=USER_ERRORS)[0]
