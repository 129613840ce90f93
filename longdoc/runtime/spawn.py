"""Run a function on N local gloo ranks in fresh processes, failing fast instead of hanging.

Used by tests, `longdoc verify` and `longdoc bench` to run CP on one machine without a launcher
(multi-node runs use `accelerate launch`).

Ranks are forked from a server process that has imported torch, transformers and longdoc's CP layers once
(multiprocessing's "forkserver" start method, where the platform has it; LONGDOC_START_METHOD=spawn starts each
rank as a fresh interpreter instead): starting two ranks then takes about a quarter of a second instead of the
several seconds of importing torch and transformers in every rank, which is most of what a short CP run (a
`--cp 2` evaluation, a test) used to spend. Each rank still starts clean: it is a fork of the server (which only
imported modules, never computed), not of the caller, and it takes the caller's environment variables as they are
at the call (set before any module reads them again; a module that read one at import reads the server's).

Every collective gets a process-group timeout, the whole run a wall-clock deadline, and leftover
processes are killed. A rank's exception comes back with its traceback, except the types named in
`input_errors` (the command lines pass longdoc.errors.USER_ERRORS): those are bad input, raised alike on
every rank, and come back as the exception itself, so the parent shows the same one line as a single process.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp


def _portable(e: BaseException) -> BaseException:
    """`e` if it rebuilds from its reduce tuple (what sending it through the rank's pipe does) as the same type and
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


# What the fork server imports once, for every rank it starts (the import takes seconds; the fork does not). The
# model loader resolves transformers' Auto classes, whose lazy import structure alone takes about 2 s per process;
# the trainer reads its rows through datasets (another 1-2 s).
PRELOAD = ["torch", "transformers", "longdoc.runtime.launch", "longdoc.parallel", "longdoc.hf",
           "longdoc.models.loading", "accelerate", "peft", "datasets"]


def _context():
    """The multiprocessing context ranks start in: forkserver with PRELOAD where available, else spawn."""
    method = os.environ.get("LONGDOC_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call), ignored afterwards
    return ctx


def _entry(rank, world_size, init_file, pg_timeout, threads, fn, args, report, input_errors=(), environ=None):
    if environ is not None:  # the caller's environment at the call, not the fork server's from its start
        os.environ.clear()
        os.environ.update(environ)
    import torch

    from longdoc.runtime.budgets import return_freed_memory
    from longdoc.runtime.launch import process_group

    return_freed_memory()  # resident memory follows the live tensors, as in `longdoc train` (glibc keeps freed heap)
    torch.set_num_threads(threads)
    if rank != 0:
        _no_progress_bars()
    # `report` is this rank's own pipe, and send() returns once the result is in it: once the rank has exited, the
    # parent finds its message there (longdoc.runtime.spawn._collect reads the exit code first, then the pipe).
    try:
        with process_group("gloo", timeout=pg_timeout, init_method=f"file://{init_file}", rank=rank,
                           world_size=world_size):
            # reported before the group is torn down, so a slow teardown never delays the result
            report.send(("ok", fn(rank, world_size, *args)))
    except input_errors as e:
        report.send(("input_error", _portable(e)))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        report.send(("error", traceback.format_exc()))
    finally:
        report.close()


def _collect(procs, readers, deadline: float, pg_timeout: float, input_error_grace: float) -> dict[int, tuple]:
    """Each rank's (status, value) as it arrives, until all have reported or the deadline passes. A rank
    that failed or ended without reporting (killed, crashed) takes no part in the others' collectives: they
    then get one process-group timeout (at most a minute) to notice and report, no more."""
    out: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + deadline
    pending = dict(enumerate(readers))
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            break
        wait(list(pending.values()) + [procs[r].sentinel for r in pending], timeout=min(left, 3600))
        for r, conn in list(pending.items()):  # every pending rank, not only those `wait` named: one may end now
            # exit code first: a rank sends before it exits, so once it has exited its message (or EOF) is readable
            ended = procs[r].exitcode is not None
            try:
                if conn.poll():
                    out[r] = conn.recv()
            except (EOFError, OSError):  # the rank's pipe closed without a message: it died
                ended = True
            if r in out or ended:
                del pending[r]
                if r not in out or out[r][0] == "error":  # the others wait on it in vain, or fail soon
                    end = min(end, time.monotonic() + min(pg_timeout, 60) + 10)
                elif out[r][0] == "input_error":  # bad input: the others raise the same soon, or wait in vain
                    end = min(end, time.monotonic() + input_error_grace)
    return out


def run_local(world_size: int, fn: Callable[..., Any], *args: Any, deadline: float = 300,
              pg_timeout: float = 30, threads: int = 1, allow_errors: bool = False,
              input_errors: tuple[type[BaseException], ...] = (), input_error_grace: float = 15) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return per-rank results.

    With allow_errors, a failing rank's entry is ("error", traceback) instead of raising.
    A rank raising one of `input_errors` makes the parent raise that exception (the lowest such rank's; it
    wins over other ranks' tracebacks, which are then consequences such as a peer timing out); the ranks
    still running get `input_error_grace` seconds to finish or raise the same, then are stopped.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, init_file, pg_timeout, threads, fn, args, pipes[r][1],
                                             tuple(input_errors), dict(os.environ)), daemon=True)
            for r in range(world_size)
        ]
        try:
            for p, (_, send) in zip(procs, pipes):
                p.start()
                send.close()  # the rank holds the only writing end: its exit closes the pipe
            out = _collect(procs, [recv for recv, _ in pipes], deadline, pg_timeout, input_error_grace)
        finally:
            for p in procs:
                if p.pid is None:
                    continue
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            for recv, _ in pipes:
                recv.close()
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
