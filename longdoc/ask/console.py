"""The interactive prompt of `longdoc ask` and the ranks' side of it.

The FRONT owns the terminal, in the main thread of the process the user started: it reads a line (`input` with
`readline`: line editing, history), hands it to rank 0 through a `Relay`, and prints what rank 0 sends back as
it is generated. Ctrl-C there, while an answer streams, sets the relay's interrupt flag; Ctrl-D sends the end.
The RANKS run in a background thread of that process (--cp 1, and rank 0 under a launcher) or as spawned local
processes (--cp N), which ignore SIGINT: Ctrl-C reaches every process of the terminal, and a rank stopped in the
middle of a collective would leave its peers hanging. The front's other threads block SIGINT, so that the signal
always wakes the main thread, even at the prompt (`sigint_blocked`). Rank 0 passes each line to the other ranks
(`next_line`), and every generated token the ranks agree whether to stop (rank 0's interrupt flag, one tiny
all-reduce), so all of them stop at the same token and roll back to the document's prefill.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from longdoc.eval.prompts import Prompter
from longdoc.eval.runner import check_context, run
from longdoc.hf.session import KVSession
from longdoc.parallel import comm
from longdoc.parallel.api import ContextParallel

HEARTBEAT = 2.0  # seconds rank 0 waits for a line before telling the other ranks to keep waiting (collective timeout)
_WAIT, _END = -2, -1  # what rank 0 sends instead of a line's length
PROMPT = "> "


def prefill_line(info: dict[str, Any]) -> str:
    return f"prefill: {info['tokens']:,} tokens in {info['seconds']:.1f} s (cp={info['cp']})"


@dataclass
class Relay:
    """Between the front and rank 0: lines in (None: the end), events out (("ready", prefill info), ("text", new
    text), ("error", message), ("done", "stopped" or "")), and the interrupt flag the front sets on Ctrl-C.
    Thread queues when rank 0 runs in the front's process, multiprocessing ones when it is spawned."""

    lines: Any
    events: Any
    interrupt: Any

    @classmethod
    def make(cls, ctx: Any = None) -> Relay:
        if ctx is None:
            return cls(queue.Queue(), queue.Queue(), threading.Event())
        return cls(ctx.Queue(), ctx.Queue(), ctx.Event())


def ignore_interrupts() -> None:
    """A rank ignores SIGINT (Ctrl-C is the front's); only the main thread can set a handler, and a rank running
    in the front's own process (a background thread) leaves the front's alone."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


# ---- the ranks' side ----

def serve(session: KVSession, prompter: Prompter, relay: Relay | None, cfg: dict[str, Any],
          info: dict[str, Any]) -> None:
    """Answer every line the front sends, until it sends the end (every rank calls this; rank 0 with the relay).
    A question that does not fit the model's context after the document is refused in one line, identically on
    every rank (the line is), and the prompt goes on."""
    device = session.state.key_positions.device
    if relay is not None:
        relay.events.put(("ready", info))
    while (line := next_line(session.cp, relay, device)) is not None:
        suffix = prompter.suffix(line)
        try:
            check_context(session.model, session.length + len(suffix) + cfg["max_new_tokens"],
                          f"the question ({len(suffix)} tokens) and an answer of up to {cfg['max_new_tokens']} after "
                          f"the document's {session.length}")
        except ValueError as e:
            if relay is not None:
                relay.events.put(("error", str(e)))
            continue
        stopped = stream_answer(session, prompter, relay, suffix, cfg["max_new_tokens"], device)
        if relay is not None:
            relay.events.put(("done", "stopped" if stopped else ""))


def next_line(cp: ContextParallel, relay: Relay | None, device: torch.device) -> str | None:
    """The front's next line on every rank (None at the end): rank 0 reads it from the relay and sends it to the
    others; while the user types, it tells them every HEARTBEAT seconds to keep waiting, so an idle prompt never
    runs into the collectives' timeout."""
    while True:
        code, data = _WAIT, b""
        if relay is not None:
            try:
                line = relay.lines.get(timeout=HEARTBEAT)
                data = b"" if line is None else line.encode("utf-8")
                code = _END if line is None else len(data)
            except queue.Empty:
                pass
        if cp.size > 1:
            code, data = _from_rank0(cp, device, code, data)
        if code != _WAIT:
            return None if code == _END else data.decode("utf-8")


def _from_rank0(cp: ContextParallel, device: torch.device, code: int, data: bytes) -> tuple[int, bytes]:
    """Rank 0's (code, bytes) on every rank: sums in which the other ranks add zeros."""
    where = cp.comm_device(device)
    mine = torch.tensor([code if cp.rank == 0 else 0], dtype=torch.int64, device=where)
    code = int(comm.all_reduce(mine, cp.group, cp.timeout, cp.guard, "all_reduce ask line length")[0])
    if code > 0:
        buf = torch.tensor(list(data), dtype=torch.int64, device=where) if cp.rank == 0 else \
            torch.zeros(code, dtype=torch.int64, device=where)
        data = bytes(comm.all_reduce(buf, cp.group, cp.timeout, cp.guard, "all_reduce ask line").tolist())
    return code, data


class Stream:
    """Rank 0's incremental detokenizer, as transformers' TextStreamer: after each token, the text not sent yet (held
    back while it ends in an incomplete character), up to the first stop token; after a line ends it decodes from
    there on, so a long answer is not decoded again from its start at every token."""

    def __init__(self, prompter: Prompter, send: Callable[[str], None]) -> None:
        self.prompter, self.send = prompter, send
        self.stops = set(prompter.stop_ids())
        self.start, self.sent = 0, 0  # first id of the current line, its characters sent

    def push(self, ids: list[int]) -> None:
        cut = next((i for i, t in enumerate(ids) if t in self.stops), len(ids))
        text = self.prompter.tok.decode(ids[self.start:cut], skip_special_tokens=True)
        text = text.lstrip() if self.start == 0 else text  # an answer starts at its first visible character
        if text.endswith("\ufffd") or len(text) <= self.sent:
            return
        self.send(text[self.sent:])
        self.start, self.sent = (cut, 0) if text.endswith("\n") else (self.start, len(text))


def stream_answer(session: KVSession, prompter: Prompter, relay: Relay | None, suffix: list[int], max_new_tokens: int,
                  device: torch.device) -> bool:
    """Greedy answer after `suffix`, streamed by rank 0 token by token; stops early on every rank at the same
    token once rank 0's interrupt flag is set. The session is rolled back to where it was. Returns whether the
    answer was stopped."""
    cp, stopped = session.cp, False
    stream = Stream(prompter, lambda text: relay.events.put(("text", text))) if relay is not None else None

    def stop(tokens: torch.Tensor) -> torch.Tensor:  # (1, steps) so far, the same on every rank
        nonlocal stopped
        flag = 0
        if relay is not None:
            stream.push(tokens[0].tolist())
            flag = int(relay.interrupt.is_set())
        if cp.size > 1:
            mine = torch.tensor([flag], dtype=torch.int64, device=cp.comm_device(device))
            flag = int(comm.all_reduce(mine, cp.group, cp.timeout, cp.guard, "all_reduce ask stop")[0])
        stopped = stopped or bool(flag)
        return torch.tensor([bool(flag)], device=tokens.device)

    mark = session.mark()
    try:
        logits = session.extend(torch.tensor([suffix], dtype=torch.long, device=device))[:, -1]
        session.decode(logits, max_new_tokens, prompter.stop_ids(), stop=stop)
    finally:
        session.rollback(mark)
    return stopped


# ---- the front ----

class _Ranks(threading.Thread):
    """`run(job, cfg)` (longdoc.eval.runner.run: spawned ranks, or this process's rank) in a background thread; its
    exception is kept for the front to raise."""

    def __init__(self, run: Callable[..., Any], job: Callable[..., Any], cfg: dict[str, Any]) -> None:
        super().__init__(daemon=True, name="longdoc-ask-ranks")  # Ctrl-C before the prompt opens ends the program
        self.call = lambda: run(job, cfg)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.call()
        except BaseException as e:  # noqa: BLE001 - handed to the front, which raises it
            self.error = e


def interactive(cfg: dict[str, Any], job: Callable[..., Any]) -> int:
    """The prompt in this thread, the ranks of `job` in the background (--cp N: spawned local processes; else this
    process's rank in a thread). Under a launcher rank 0 is the front and the other ranks only run `job`."""
    from longdoc.runtime.launch import launched_world

    world = launched_world()
    if world.launched and not world.is_main:
        run(job, cfg)
        return 0
    spawned = not world.launched and int(cfg.get("cp", 1)) > 1
    relay = Relay.make(torch.multiprocessing.get_context("spawn") if spawned else None)
    ranks = _Ranks(run, job, {**cfg, "relay": relay})
    with sigint_blocked():
        ranks.start()
    try:
        front(relay, ranks)
    except KeyboardInterrupt:  # while loading and prefilling: there is no answer to stop yet
        print("\nlongdoc ask: interrupted", file=sys.stderr)
        return 130
    ranks.join()
    if ranks.error is not None:
        raise ranks.error
    return 0


def front(relay: Relay, ranks: threading.Thread) -> None:
    """Prompt, send, print the streamed answer; until Ctrl-D (or the ranks end, e.g. on an error)."""
    _line_editing()
    kind, info = _event(relay, ranks)
    if kind != "ready":
        return
    print(prefill_line(info), file=sys.stderr, flush=True)
    while (line := _read()) is not None:
        if not line.strip():
            continue
        relay.interrupt.clear()
        with sigint_blocked():
            relay.lines.put(line)
        if not _stream(relay, ranks):
            return
    with sigint_blocked():
        relay.lines.put(None)


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block, so that threads started in it (the ranks' thread, the feeder
    thread a multiprocessing queue starts on its first put) inherit the mask. Ctrl-C then reaches the main thread
    only: the kernel may hand a process's signal to any thread that does not block it, and one given to another
    thread would not wake `input()`'s wait at the prompt."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to do
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _line_editing() -> None:
    try:
        import readline  # noqa: F401 - importing it gives input() line editing and history
    except ImportError:  # a Python built without it: plain input()
        pass


def _read() -> str | None:
    """The user's next line; None on Ctrl-D (end of input). Ctrl-C at the prompt starts a fresh line."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print()


def _event(relay: Relay, ranks: threading.Thread) -> tuple[str | None, Any]:
    """Rank 0's next event, or (None, None) once the ranks have ended without one."""
    while True:
        try:
            return relay.events.get(timeout=0.2)
        except queue.Empty:
            if not ranks.is_alive():
                try:
                    return relay.events.get_nowait()
                except queue.Empty:
                    return None, None


def _stream(relay: Relay, ranks: threading.Thread) -> bool:
    """Print one answer as rank 0 sends it; Ctrl-C meanwhile asks the ranks to stop it. False if the ranks ended."""
    while True:
        try:
            kind, value = _event(relay, ranks)
            if kind == "text":
                sys.stdout.write(value)
                sys.stdout.flush()
                continue
        except KeyboardInterrupt:
            relay.interrupt.set()
            continue
        break
    if kind == "error":
        print(f"longdoc ask: {value}", file=sys.stderr, flush=True)
    elif kind == "done":
        print(" [stopped]" if value == "stopped" else "", flush=True)
    return kind is not None
