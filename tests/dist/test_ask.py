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
