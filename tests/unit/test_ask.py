"""`longdoc ask` at cp=1 (tiny random model, offline tokenizer): --question answers from one prefill equal plain
greedy decoding of the same prompt, bad input is one line and exit 2 before any weights load, a document past
the model's context is refused naming the RoPE extension, and the interactive prompt answers, stops one answer
on Ctrl-C and ends on Ctrl-D."""

from __future__ import annotations

import builtins
import sys
import time

import pytest
import torch

from longdoc.cli import main
from tests.support.document_files import mixed_folder

MODEL = "tiny:llama"
QUESTIONS = ["Who was admitted, and when?", "What does the clerk do on Monday?"]
NEW = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made = mixed_folder(tmp_path_factory.mktemp("docs"))
    return [str(made["txt"]), str(made["docx"])]


@pytest.fixture(scope="module")
def reference(files):
    """The answers of plain greedy decoding (full forward per token, no cache, no CP) of each question's prompt:
    the document prefix `longdoc eval qa` uses and the question suffix."""
    from longdoc import models
    from longdoc.ask.answer import answer_text
    from longdoc.eval.data import read_texts
    from longdoc.eval.prompts import Prompter

    model, tok = models.load(MODEL)
    prompter = Prompter(tok)
    prefix = prompter.prefix("\n\n".join(t.strip() for t in read_texts(files)))
    out = []
    for q in QUESTIONS:
        ids = torch.tensor([prefix + prompter.suffix(q)])
        new: list[int] = []
        with torch.no_grad():
            for _ in range(NEW):
                new.append(int(model(input_ids=torch.cat([ids, torch.tensor([new], dtype=torch.long)], 1)
                                     ).logits[0, -1].argmax()))
                if new[-1] in prompter.stop_ids():
                    break
        out.append(answer_text(prompter, new))
    return {"answers": out, "tokens": len(prefix)}


def _answers(stdout: str) -> list[str]:
    return [line[3:] for line in stdout.splitlines() if line.startswith("A: ")]


def test_questions_are_answered_from_one_prefill(files, reference, capsys, monkeypatch):
    from longdoc.hf.session import KVSession

    prefills = []
    real = KVSession.prefill
    monkeypatch.setattr(KVSession, "prefill", lambda self, ids: prefills.append(ids.shape) or real(self, ids))
    for batch in ("16", "1"):  # decoded together as branches of the prefill, then one at a time with rollback
        args = ["ask", MODEL, *files, "--max-new-tokens", str(NEW), "--threads", "1", "--batch", batch]
        assert main([*args, *(x for q in QUESTIONS for x in ("--question", q))]) == 0
        out, err = capsys.readouterr()
        assert _answers(out) == reference["answers"], out
        assert [line for line in out.splitlines() if line.startswith("Q: ")] == [f"Q: {q}" for q in QUESTIONS]
        assert err.startswith(f"prefill: {reference['tokens']:,} tokens in ") and err.endswith(" s (cp=1)\n"), err
    assert prefills == [(1, reference["tokens"])] * 2  # one prefill per run, shared by both questions


@pytest.fixture()
def no_model(monkeypatch):
    """Fail the test if weights load or ranks start."""
    import longdoc.eval.runner
    import longdoc.runtime.spawn

    monkeypatch.setattr(longdoc.eval.runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(longdoc.runtime.spawn, "run_local", lambda *a, **k: pytest.fail("the ranks started"))


def _refused(capsys, *args: str) -> str:
    assert main(["ask", *args], catch=True) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("longdoc ask: error: "), err
    return err


def test_bad_files_are_one_line_and_exit_2_before_any_model_loads(files, tmp_path, capsys, no_model):
    folder = mixed_folder(tmp_path / "more")
    err = _refused(capsys, MODEL, files[0], str(tmp_path / "missing.txt"), "--question", "q", "--cp", "2")
    assert "missing.txt does not exist" in err
    assert "unknown file type '.png'" in _refused(capsys, MODEL, str(folder["png"]), "--question", "q")
    broken = tmp_path / "broken.docx"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    assert "broken.docx: not a readable" in _refused(capsys, MODEL, str(broken))
    assert "--question is empty" in _refused(capsys, MODEL, files[0], "--question", " ")
    assert "unknown tiny architecture" in _refused(capsys, "tiny:lama", files[0])


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny model folder whose context is 256 positions (no RoPE scaling)."""
    from longdoc import models

    folder = tmp_path_factory.mktemp("m") / "short"
    model, tok = models.load(MODEL, max_position_embeddings=256)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_document_past_the_context_is_refused_naming_the_rope_extension(short_model, tmp_path, capsys,
                                                                          monkeypatch):
    long = tmp_path / "long.txt"
    long.write_text(" ".join(f"On day {i} the clerk docketed filing {i * 7 % 31}." for i in range(25)))
    with monkeypatch.context() as m:
        import longdoc.eval.runner

        m.setattr(longdoc.eval.runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
        err = _refused(capsys, short_model, str(long), "--question", "Which filing on day 3?", "--cp", "2")
    assert "long.txt: the document's prompt of" in err and "exceeds the model's context (256 tokens)" in err
    assert "--rope-type yarn --rope-factor 2" in err, err
    # the fix it names works
    assert main(["ask", short_model, str(long), "--question", "Which filing on day 3?", "--max-new-tokens", "4",
                 "--rope-type", "yarn", "--rope-factor", "2", "--threads", "1"]) == 0
    assert len(_answers(capsys.readouterr().out)) == 1


class _Keyboard:
    """stdout whose first write of an answer raises KeyboardInterrupt (Ctrl-C while it streams), once."""

    def __init__(self, out) -> None:
        self.out, self.armed = out, False

    def write(self, text: str) -> int:
        if self.armed and text.strip():
            self.armed = False
            raise KeyboardInterrupt
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def _typed(lines: list[str], on_read=None):
    """A fake `input`: the lines, then Ctrl-D (EOFError)."""
    feed = iter(lines)

    def read(prompt: str = "") -> str:
        if on_read is not None:
            on_read()
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


def test_the_prompt_answers_streams_and_ends_on_ctrl_d(files, reference, capsys, monkeypatch):
    monkeypatch.setattr(builtins, "input", _typed([QUESTIONS[0], "   ", QUESTIONS[1]]))
    assert main(["ask", MODEL, *files, "--max-new-tokens", str(NEW), "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(f"{a}\n" for a in reference["answers"]) + "\n", out  # the blank line: Ctrl-D's newline
    assert err.startswith(f"prefill: {reference['tokens']:,} tokens in "), err


def test_ctrl_c_stops_one_answer_and_the_prompt_goes_on(files, reference, capsys, monkeypatch):
    from longdoc.hf.session import KVSession

    real, steps, at_prompt = KVSession.extend, [0], []

    def slow(self, ids, keep=1):  # decode steps slow enough for the interrupt to land mid-answer
        if ids.shape[-1] == 1:
            steps[0] += 1
            time.sleep(0.05)
        return real(self, ids, keep)

    def prompt() -> None:
        at_prompt.append(steps[0])
        stdout.armed = len(at_prompt) == 1  # Ctrl-C during the first answer only

    monkeypatch.setattr(KVSession, "extend", slow)
    stdout = _Keyboard(sys.stdout)
    monkeypatch.setattr(builtins, "input", _typed(QUESTIONS, prompt))
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["ask", MODEL, *files, "--max-new-tokens", "12", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    first, rest = out.split(" [stopped]\n")  # answers may hold newlines of their own
    second = rest[:-2].strip()
    assert at_prompt[1] < 8 and rest.endswith("\n\n"), (out, at_prompt)  # stopped within a few tokens
    # the second answer is whole (11 decode steps after its first token, unless it ended) and right: the stopped
    # one left nothing behind in the cache; its first 8 tokens are the reference's answer
    assert second.startswith(reference["answers"][1]), out
    assert at_prompt[2] - at_prompt[1] == 11 or len(second) < len(reference["answers"][1]) + 5, (out, at_prompt)


def test_a_question_past_the_context_is_refused_and_the_prompt_goes_on(short_model, tmp_path, capsys, monkeypatch):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"On day {i} the clerk docketed filing {i * 7 % 31}." for i in range(12)))
    long_question = "Which filings were docketed " + " and ".join(f"on day {i}" for i in range(40)) + "?"
    monkeypatch.setattr(builtins, "input", _typed([long_question, "Which filing on day 3?"]))
    assert main(["ask", short_model, str(doc), "--max-new-tokens", "4", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    refusals = [line for line in err.splitlines() if line.startswith("longdoc ask: ")]
    assert len(refusals) == 1 and "exceeds the model's context (256 tokens)" in refusals[0], err
    assert "--rope-type yarn --rope-factor 2" in refusals[0], err
    assert out.count("\n") == 2 and out.strip(), out  # the short question's answer, then Ctrl-D's newline


def test_an_error_on_the_ranks_ends_the_prompt_with_one_line(files, capsys, monkeypatch):
    from longdoc.hf.session import KVSession

    def refuse(self, ids):
        raise ValueError("this model cannot prefill here")

    monkeypatch.setattr(KVSession, "prefill", refuse)
    monkeypatch.setattr(builtins, "input", _typed([QUESTIONS[0]]))
    assert main(["ask", MODEL, *files, "--threads", "1"], catch=True) == 2
    assert capsys.readouterr().err == "longdoc ask: error: this model cannot prefill here\n"


def test_the_stream_sends_every_character_once():
    """Token by token, across line ends and characters split over several tokens, the pieces rank 0 sends make
    the answer's text (from its first visible character, up to the first stop token)."""
    from longdoc import models
    from longdoc.ask.console import Stream
    from longdoc.eval.prompts import Prompter

    prompter = Prompter(models.load_tokenizer(MODEL))
    text = "  Café au lait\nnaïve — 東京 🚀\n\nend"
    ids = prompter.tok(text, add_special_tokens=False)["input_ids"]
    ids += [prompter.stop_ids()[0], *ids[:3]]  # after a stop token nothing more is sent
    sent: list[str] = []
    stream = Stream(prompter, sent.append)
    for n in range(1, len(ids) + 1):
        stream.push(ids[:n])
    assert "".join(sent) == text.lstrip() and len(sent) > 5, sent


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])  # branches; a window: one question at a time
def test_greedy_each_continues_every_suffix_from_one_prefill(arch):
    """longdoc.hf.branches.greedy_each, ask's decoder for --question: each suffix's greedy tokens over the one
    prefill equal plain greedy decoding of prefix + suffix, and the session is left at the prefix."""
    import longdoc
    from longdoc.hf.branches import greedy_each
    from longdoc.hf.session import KVSession
    from longdoc.models import tiny_model

    model = tiny_model(arch).eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 256, (1, 40), generator=gen)  # past the window of 32
    suffixes = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 9, 1)]
    with KVSession(model, longdoc.ContextParallel()) as session:
        session.prefill(prefix)
        assert (session.branch_problem() is None) == (arch == "llama")
        got = greedy_each(session, suffixes, 4, eos_token_id=[])
        assert session.length == prefix.shape[1]
    for suffix, tokens in zip(suffixes, got):
        ids = torch.cat([prefix, torch.tensor([suffix])], 1)
        want = []
        with torch.no_grad():
            for _ in range(4):
                want.append(int(model(input_ids=ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[want[-1]]])], 1)
        assert tokens == want, (suffix, tokens, want)


def test_skip_bad_leaves_out_what_cannot_be_read_and_names_it(tmp_path, capsys):
    folder = mixed_folder(tmp_path / "docs")["png"].parent  # a PDF, a DOCX, an HTML, a text file and an image
    assert "scan.png" in _refused(capsys, MODEL, str(folder), "--question", "Where?")
    assert main(["ask", MODEL, str(folder), "--skip-bad", "--question", "Where?", "--max-new-tokens", "2",
                 "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    skipped = [line for line in err.splitlines() if line.startswith("longdoc ask: skipped ")]
    assert len(skipped) == 1 and "scan.png" in skipped[0] and "prefill: " in err, err
    assert len(_answers(out)) == 1, out


def _needs(model: str, files: list[str], upto: int = 8) -> list[float]:
    """GiB one rank needs for the prefill of `files` at cp 1..upto (fp32, ring, CPU): longdoc.plan.prefill's estimate,
    which tests/unit/test_plan_prefill.py checks term by term."""
    from longdoc import models
    from longdoc.eval.data import read_texts
    from longdoc.eval.prompts import Prompter
    from longdoc.plan.prefill import prefill_bytes
    from longdoc.plan.shapes import model_shape

    prefix = Prompter(models.load_tokenizer(model)).prefix("\n\n".join(t.strip() for t in read_texts(files)))
    return [prefill_bytes(model_shape(model), len(prefix), n) / 2**30 for n in range(1, upto + 1)]


def _available(monkeypatch, gib: float) -> None:
    import longdoc.plan.hardware

    monkeypatch.setattr(longdoc.plan.hardware, "machine_available_gib", lambda: gib)


def test_a_prefill_past_the_memory_is_refused_naming_the_cp_that_fits(files, capsys, monkeypatch, no_model):
    """Under a launcher with one CPU rank per node a rank's memory is its node's: the line names the smallest cp
    whose share of the prompt fits, before any process group or weights."""
    need = _needs(MODEL, files)
    _available(monkeypatch, (need[2] + need[3]) / 2)  # --cp 4 fits, --cp 3 does not
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("GROUP_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    err = _refused(capsys, MODEL, *files, "--question", "Who?", "--cp", "2", "--device", "cpu")
    assert f"needs about {need[1]:.2f} GiB per rank at --cp 2 (" in err, err
    assert "shared by its 1 ranks" in err and "launch 4 processes with --cp 4" in err, err


def test_local_ranks_share_the_host_so_the_line_names_ranks_across_nodes(files, capsys, monkeypatch, no_model):
    """Spawned local ranks share this host's memory and each holds the weights: no --cp fits where --cp 1 does
    not, and the line names the cp that fits one rank per node of this host's memory."""
    need = _needs(MODEL, files)
    _available(monkeypatch, (need[2] + need[3]) / 2)
    err = _refused(capsys, MODEL, *files, "--question", "Who?", "--cp", "2")
    assert "shared by the --cp ranks" in err and "more ranks on this host share its memory" in err, err
    assert "launch 4 ranks across nodes with this host's memory each (--cp 4, about" in err, err


def test_a_document_past_the_context_and_the_memory_names_both_fixes(short_model, tmp_path, capsys, monkeypatch,
                                                                     no_model):
    long = tmp_path / "long.txt"
    long.write_text(" ".join(f"On day {i} the clerk docketed filing {i * 7 % 31}." for i in range(25)))
    need = _needs(short_model, [str(long)])
    _available(monkeypatch, (need[1] + need[2]) / 2)
    err = _refused(capsys, short_model, str(long), "--question", "Which filing on day 3?")
    assert "exceeds the model's context (256 tokens)" in err, err
    assert "extend it with --rope-type yarn --rope-factor 2" in err, err
    assert " and run on a machine with more memory, or launch 3 ranks across nodes" in err, err
    assert "(--cp 3, about" in err and err.index("--rope-type") < err.index("--cp 3"), err
