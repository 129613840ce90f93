"""Every bad input is ONE line on stderr and exit status 2, the same line whether the mistake surfaces in the
parent process or inside spawned CP ranks (`--cp 2`, `cp_size=2`). Bugs are another matter (exit 3 with a
traceback); verify's FAIL keeps exit 1.

The cases call `longdoc` in the test's process (tests.support.cli.here: the console script's own entry, both file
descriptors captured; a `--cp 2` spelling really starts its ranks), as importing torch and transformers for each
would cost seconds. What only a fresh process shows, that nothing else reaches the terminal (a library's warning;
a traceback or progress bar from a spawned rank), the FRESH cases check with `python -m longdoc`, as a user runs
it. Progress bars are switched off (HF_HUB_DISABLE_PROGRESS_BARS): loading a saved folder draws one on stderr,
which is progress, not a message. The default suite runs one case of each kind (parent side, spawned verify and
train ranks); the rest of the matrix is slow."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.cli import fresh, here

REFUSED = "longdoc.patch: BloomForCausalLM"  # a model CP refuses by name (Mamba2 is exact since 2026-12)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A QA file, a recipe, and a Mamba2 model (config.json and a saved folder with a tokenizer): a layer kind
    longdoc refuses by name today."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from longdoc import models

    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "qa.jsonl").write_text(json.dumps({"document": "The fee was 120 dollars in all.", "question": "fee?",
                                              "answer": "120 dollars"}) + "\n")
    (tmp / "recipe.yaml").write_text("data: {path: random, seq_len: 64, random_size: 4}\ntrain: {steps: 1}\n"
                                     "log: {progress: false, tensorboard: false, plot: false}\n")
    config = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=49152)
    config.to_json_file(tmp / "alibi.json")
    folder = tmp / "alibi"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    models.load_tokenizer().save_pretrained(folder)
    return tmp


def _one_line(proc: subprocess.CompletedProcess, argv: list[str]) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (argv, proc.returncode, proc.stderr[-3000:])
    return lines[0]


SLOW = pytest.mark.slow
CP1, CP2 = ["parallelism.cp_size=1"], ["parallelism.cp_size=2"]  # `longdoc train`'s two spellings
# (verb and arguments, the one-process spelling, the --cp 2 spelling, what the line says)
CASES = [
    (["eval", "qa", "--model", "does-not-exist", "--data", "qa.jsonl"], ["--cp", "1"], ["--cp", "2"],
     "longdoc eval qa: error: cannot load 'does-not-exist' from the Hugging Face hub: offline mode is on"),
    pytest.param(["eval", "qa", "--model", "tiny:lama", "--data", "qa.jsonl"], ["--cp", "1"], ["--cp", "2"],
                 "longdoc eval qa: error: unknown tiny architecture 'lama' in 'tiny:lama' (choose from llama, ",
                 marks=SLOW),
    pytest.param(["eval", "needle", "--model", "nope", "--lengths", "256"], ["--cp", "1"], ["--cp", "2"],
                 "longdoc eval needle: error: cannot load 'nope' from the Hugging Face hub", marks=SLOW),
    pytest.param(["eval", "qa", "--model", "alibi", "--data", "qa.jsonl"], ["--cp", "1"], ["--cp", "2"],
                 f"longdoc eval qa: error: {REFUSED}", marks=SLOW),
    (["eval", "qa", "--model", "tiny:llama", "--data", "missing.jsonl"], ["--cp", "1"], ["--cp", "2"],
     "longdoc eval qa: error: "),
    pytest.param(["verify", "--model", "tiny:lama", "--seq-len", "64"], ["--cp", "1"], ["--cp", "2"],
                 "longdoc verify: error: unknown tiny architecture 'lama' in 'tiny:lama'", marks=SLOW),
    (["verify", "--model", "alibi.json", "--seq-len", "64"], ["--cp", "1"], ["--cp", "2"],
     f"longdoc verify: error: {REFUSED}"),
    (["verify", "--model", "tiny:llama", "--seq-len", "64", "--text", "missing.txt"], ["--cp", "1"], ["--cp", "2"],
     "longdoc verify: error: --text 'missing.txt' is not a file"),
    (["train", "recipe.yaml", "output_dir=out-m", "model.name=./alibi"], CP1, CP2,
     f"longdoc train: error: {REFUSED}"),
    pytest.param(["train", "recipe.yaml", "output_dir=out-t", "model.name=tiny:lama"], CP1, CP2,
                 "longdoc train: error: unknown tiny architecture 'lama' in 'tiny:lama'", marks=SLOW),
    (["train", "recipe.yaml", "train.stepz=3"], CP1, CP2,
     "longdoc train: error: unknown recipe key train.stepz (did you mean train.steps?)"),
    pytest.param(["train", "missing.yaml"], CP1, CP2, "longdoc train: error: ", marks=SLOW),
    pytest.param(["ask", "alibi", "qa.jsonl", "--question", "fee?"], ["--cp", "1"], ["--cp", "2"],
                 f"longdoc ask: error: {REFUSED}", marks=SLOW),
]


def _name(argv: list[str]) -> str:
    return " ".join(a for a in argv[:4] if not a.endswith((".jsonl", ".yaml")))


def _id(case) -> str:
    return _name(case.values[0] if hasattr(case, "values") else case[0])


# Cases whose refusal surfaces inside the spawned ranks: their --cp 2 spelling runs as a fresh `python -m longdoc`,
# the only way to see that nothing from a rank reaches the terminal; one per kind of rank (train in the default
# suite, verify and eval in the slow one). Every other spelling runs in this process.
FRESH = {"train output_dir=out-m model.name=./alibi", "verify --model tiny:lama --seq-len", "eval qa --model alibi"}


@pytest.mark.parametrize("argv, one, two, says", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_one_line_and_exit_2_with_and_without_cp(inputs, monkeypatch, capfd, argv, one, two, says):
    def longdoc(*args: str) -> subprocess.CompletedProcess:
        return here(*args, cwd=inputs, monkeypatch=monkeypatch, capfd=capfd)

    single = _one_line(longdoc(*argv, *one), argv + one)
    spawned = _one_line((fresh(*argv, *two, cwd=inputs) if _name(argv) in FRESH else longdoc(*argv, *two)), argv + two)
    assert single.startswith(says), single
    if REFUSED in says:
        assert "uses ALiBi position biases" in single, single
    assert spawned == single


def test_exit_codes_are_in_the_help(inputs, monkeypatch, capfd):
    def help_of(*argv: str) -> str:
        proc = here(*argv, "--help", cwd=inputs, monkeypatch=monkeypatch, capfd=capfd)
        assert proc.returncode == 0 and not proc.stderr, (argv, proc.returncode, proc.stderr)
        return " ".join(proc.stdout.split())

    for argv in ([], ["verify"], ["train"]):
        out = help_of(*argv)
        assert "2 bad input, one line on stderr" in out and "3 an internal error" in out, argv
    verify_help = help_of("verify")
    assert "1 the run's own negative verdict (verify: FAIL" in verify_help
    from longdoc.models import zoo

    for name in zoo.NAMES:  # tiny names come from the registry
        assert name in verify_help
