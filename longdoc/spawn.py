"""Run a function on N local gloo ranks in fresh processes, failing fast instead of hanging.

Used by tests, `longdoc verify` and `longdoc bench` to run CP on one machine without a launcher
(multi-node runs use `accelerate launch`).

Every collective gets a process-group timeout, the whole run a wall-clock deadline, and leftover
processes are killed. A rank's exception comes back with its traceback.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, pg_timeout, threads, fn, args, results):
    import torch

    from longdoc.launch import process_group

    torch.set_num_threads(threads)
    try:
        with process_group("gloo", timeout=pg_timeout, init_method=f"file://{init_file}", rank=rank,
                           world_size=world_size):
            # reported before the group is torn down, so a slow teardown never delays the result
            results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, deadline: float = 300,
              pg_timeout: float = 30, threads: int = 1, allow_errors: bool = False) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results.

    With allow_errors, a failing rank's entry is ("error", traceback) instead of raising.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, pg_timeout, threads, fn, args, results),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, tuple[str, Any]] = {}
        end = datetime.datetime.now() + datetime.timedelta(seconds=deadline)
        try:
            while len(out) < world_size:
                left = (end - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                    out[rank] = (status, value)
                except queue.Empty:
                    # A rank that exited without reporting (killed, crashed while starting) will never
                    # answer; the others get one process-group timeout to notice and report, no more.
                    if any(p.exitcode is not None for r, p in enumerate(procs) if r not in out):
                        end = min(end, datetime.datetime.now() + datetime.timedelta(seconds=pg_timeout + 10))
                        if all(p.exitcode is not None for r, p in enumerate(procs) if r not in out):
                            break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} gave no result within {deadline}s (hang or crash; exit codes {codes})")
    if allow_errors:
        return [out[r][1] if out[r][0] == "ok" else ("error", out[r][1]) for r in range(world_size)]
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(out.items()) if s == "error"]
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [out[r][1] for r in range(world_size)]
