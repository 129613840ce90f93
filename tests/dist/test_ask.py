"""`longdoc ask --cp 2` (the command spawns its 2 gloo ranks): two --question answered from one CP prefill, the same
answers as cp=1; and the interactive prompt at cp=2, whose front (this process) relays lines to rank 0 and prints
what it streams, Ctrl-C stopping one answer on both ranks."""

from __future__ import annotations

import builtins
import sys

import pytest

from longdoc.cli import main
from tests.support.document_files import mixed_folder

MODEL = "tiny:llama"
QUESTIONS = ["What is the rent?", "What does the clerk do on Monday?"]
COMMON = ["--threads", "1", "--timeout", "120"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made = mixed_folder(tmp_path_factory.mktemp("docs"))
    return [str(made["html"]), str(made["txt"])]


def _asked(capsys, files: list[str], *args: str) -> tuple[list[str], str]:
    questions = [x for q in QUESTIONS for x in ("--question", q)]
    assert main(["ask", MODEL, *files, *questions, "--max-new-tokens", "8", *COMMON, *args]) == 0
    out, err = capsys.readouterr()
    return [line[3:] for line in out.splitlines() if line.startswith("A: ")], err


def test_two_questions_from_one_cp2_prefill_equal_cp1(files, capsys):
    one, err1 = _asked(capsys, files)
    two, err2 = _asked(capsys, files, "--cp", "2")
    assert len(one) == 2 and two == one, (one, two)
    tokens = err1.split()[1]
    assert err2.startswith(f"prefill: {tokens} tokens in ") and "(cp=2)" in err2, err2


class _Keyboard:
    """stdout whose first answer text raises KeyboardInterrupt (Ctrl-C while it streams), once."""

    def __init__(self, out) -> None:
        self.out, self.armed = out, True

    def write(self, text: str) -> int:
        if self.armed and text.strip():
            self.armed = False
            raise KeyboardInterrupt
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@pytest.mark.slow  # a second start of the 2 ranks (about 25 s on 2 busy cores); the --question one covers cp=2
def test_the_prompt_at_cp2_streams_stops_on_ctrl_c_and_ends_on_ctrl_d(files, capsys, monkeypatch):
    full, _ = _asked(capsys, files, "--max-new-tokens", "64")  # cp=1: what the unstopped answers are
    lines = iter([QUESTIONS[0], QUESTIONS[1]])

    def typed(prompt: str = "") -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", typed)
    monkeypatch.setattr(sys, "stdout", _Keyboard(sys.stdout))
    assert main(["ask", MODEL, *files, "--max-new-tokens", "64", "--cp", "2", *COMMON]) == 0
    out, err = capsys.readouterr()
    first, rest = out.split(" [stopped]\n")  # answers may hold newlines of their own
    assert len(first) < len(full[0]) and rest.endswith("\n\n"), (out, full)
    assert rest[:-2].strip() == full[1], (out, full)  # whole, and as at cp=1: both ranks rolled back alike
    assert "(cp=2)" in err, err


def _terminal(argv: list[str]):
    """`argv` in a pseudo-terminal: (write bytes, read until a predicate holds, wait for the exit status)."""
    import os
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the command, as a user's shell starts it
        os.execv(argv[0], argv)
    seen = bytearray()

    def until(pred, timeout: float) -> bool:
        end = time.time() + timeout
        while not pred(bytes(seen)) and time.time() < end:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # the command ended
                    return pred(bytes(seen))
                seen.extend(chunk)
        return pred(bytes(seen))

    def status() -> int:
        until(lambda b: False, 5)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    return (lambda data: os.write(fd, data)), until, status, seen


@pytest.mark.slow  # a real terminal at cp=2: about 30 s on 2 busy cores
def test_ctrl_c_in_a_real_terminal_stops_the_answer_on_both_ranks(files):
    """Ctrl-C in a terminal is SIGINT to every process of its foreground group, the spawned ranks included: they
    ignore it, the front stops the answer, the prompt goes on; Ctrl-C at the prompt starts a fresh line."""
    write, until, status, seen = _terminal([sys.executable, "-m", "longdoc", "ask", MODEL, *files, "--cp", "2",
                                            "--max-new-tokens", "5000", *COMMON])
    prompt = lambda b: b.rstrip().endswith(b">")  # noqa: E731
    assert until(prompt, 180) and b"(cp=2)" in seen, bytes(seen)
    write(QUESTIONS[0].encode() + b"\n")
    asked = QUESTIONS[0].encode() + b"\r\n"  # echoed by the terminal, then the answer streams
    assert until(lambda b: asked in b and len(b.split(asked)[-1].strip()) > 20, 60), bytes(seen)
    write(b"\x03")
    assert until(lambda b: b.rstrip().endswith(b"[stopped]\r\n>"), 60), bytes(seen)
    write(b"\x03")  # at the prompt
    assert until(lambda b: b.rstrip().endswith(b"[stopped]\r\n> \r\n>"), 30), bytes(seen)
    write(b"\x04")
    assert status() == 0 and b"Traceback" not in seen, bytes(seen)
