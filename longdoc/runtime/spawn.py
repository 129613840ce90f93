"""Run a function on N local gloo ranks in fresh processes, failing fast instead of hanging.

Used by tests, `longdoc verify` and `longdoc bench` to run CP on one machine without a launcher
(multi-node runs use `accelerate launch`).

Every collective gets a process-group timeout, the whole run a wall-clock deadline, and leftover
processes are killed. A rank's exception comes back with its traceback, except the types named in
`input_errors` (the command lines pass longdoc.errors.USER_ERRORS): those are bad input, raised alike on
every rank, and come back as the exception itself, so the parent shows the same one line as a single process.
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


def _portable(e: BaseException) -> BaseException:
    """`e` if it rebuilds from its reduce tuple (what the result queue's pickling does) as the same type and
    message, else a RankInputError with its message."""
    from longdoc.errors import RankInputError

    try:
        rebuild, args, *state = e.__reduce__()
        back = rebuild(*args)
        if state and isinstance(state[0], dict):
            back.__dict__.update(state[0])
        if type(back) is type(e) and str(back) == str(e):
            back.__cause__ = back.__context__ = None
            return back
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send the message only
        pass
    return RankInputError(str(e))


def _no_progress_bars() -> None:
    """Ranks other than 0 draw no Hugging Face progress bars (weight loading, downloads): N ranks' bars
    interleave into noise on one terminal, and rank 0's says the same."""
    import sys

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub / transformers are imported
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()


def _entry(rank, world_size, init_file, pg_timeout, threads, fn, args, results, input_errors=()):
    import torch

    from longdoc.runtime.budgets import return_freed_memory
    from longdoc.runtime.launch import process_group

    return_freed_memory()  # resident memory follows the live tensors, as in `longdoc train` (glibc keeps freed heap)
    torch.set_num_threads(threads)
    if rank != 0:
        _no_progress_bars()
    try:
        with process_group("gloo", timeout=pg_timeout, init_method=f"file://{init_file}", rank=rank,
                           world_size=world_size):
            # reported before the group is torn down, so a slow teardown never delays the result
            results.put((rank, "ok", fn(rank, world_size, *args)))
    except input_errors as e:
        results.put((rank, "input_error", _portable(e)))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, deadline: float = 300,
              pg_timeout: float = 30, threads: int = 1, allow_errors: bool = False,
              input_errors: tuple[type[BaseException], ...] = (), input_error_grace: float = 15) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results.

    With allow_errors, a failing rank's entry is ("error", traceback) instead of raising.
    A rank raising one of `input_errors` makes the parent raise that exception (the lowest such rank's; it
    wins over other ranks' tracebacks, which are then consequences such as a peer timing out); the ranks
    still running get `input_error_grace` seconds to finish or raise the same, then are stopped.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, pg_timeout, threads, fn, args, results,
                                             tuple(input_errors)), daemon=True)
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
                    if status == "input_error":  # bad input: the others raise the same soon, or wait in vain
                        end = min(end, datetime.datetime.now() + datetime.timedelta(seconds=input_error_grace))
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
    refused = [value for _, (status, value) in sorted(out.items()) if status == "input_error"]
    if refused:
        raise refused[0]
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
