"""One length parser and one "did you mean" for every `longdoc` command line; bad input exits 2, no traceback."""

from __future__ import annotations

import argparse
import json

import pytest

from longdoc import cliargs
from longdoc.cli import build_parser, main
from tests.support.cli import fresh, here


@pytest.mark.parametrize("text, want", [("4096", 4096), ("4k", 4096), ("1.5k", 1536), ("128K", 131072),
                                        ("1M", 1048576), (" 2m ", 2097152)])
def test_length_accepts_k_and_m(text, want):
    assert cliargs.length(text) == want


@pytest.mark.parametrize("text", ["", "k", "4q", "-1k", "0", "0.3k", "1e400"])
def test_length_refuses_with_examples(text):
    with pytest.raises(argparse.ArgumentTypeError, match="such as 4096, 4k, 128k or 1M"):
        cliargs.length(text)


def test_every_length_option_takes_suffixes():
    p = build_parser()
    assert p.parse_args(["plan", "--model", "m", "--seq-len", "128k"]).seq_len == 131072
    assert p.parse_args(["verify", "--model", "m", "--cp", "2", "--seq-len", "4k"]).seq_len == 4096
    assert p.parse_args(["data", "synth", "--domain", "legal", "--tokens", "32k", "--out", "x"]).tokens == 32768
    assert p.parse_args(["data", "prepare", "a", "--out", "x", "--target-tokens", "1M"]).target_tokens == 1 << 20
    assert p.parse_args(["eval", "needle", "--lengths", "1k,2k,4096"]).lengths == [1024, 2048, 4096]
    assert p.parse_args(["eval", "position-loss", "--length", "8k"]).length == 8192
    assert p.parse_args(["bench", "--seq-len", "16k"]).seq_len == 16384


def test_mistyped_choice_says_did_you_mean(capsys):
    for argv, hint in ((["eval", "needle", "--domain", "legl"], "did you mean 'legal'?"),
                       (["eval", "qa", "--data", "x", "--strategy", "rign"], "did you mean 'ring'?"),
                       (["evl"], "did you mean 'eval'?"),
                       (["data", "prepare", "a", "--out", "x", "--task", "pretrian"], "did you mean 'pretrain'?")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
        assert hint in capsys.readouterr().err


def test_bad_input_exits_2_with_the_message_and_no_traceback(tmp_path, monkeypatch, capfd):
    """In this process (tests.support.cli.here), and the case that goes deepest as a fresh `python -m longdoc`: only
    there would a traceback that a library prints (rather than raises) or a warning reach the terminal."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    flat = tmp_path / "qa.jsonl"
    flat.write_text(json.dumps({"document": "short text", "question": "q?", "answer": "absent"}) + "\n")
    missing = str(tmp_path / "missing")
    cases = [(["eval", "position-loss", "--model", "tiny:llama", "--data", missing], "does not exist"),
             (["eval", "position-loss", "--model", "tiny:llama", "--data", str(bad)], "bad.jsonl:1: not valid JSON"),
             (["eval", "qa", "--model", "tiny:llama", "--data", str(flat)], "answer 'absent' not found"),
             (["eval", "qa", "--model", "tiny:llama", "--data", str(flat), "--rope-factor", "2"], "needs --rope-type")]
    deepest = cases[2]  # the refusal found furthest along: the file reads, its record is checked against its text
    for argv, msg in cases:
        proc = (fresh(*argv, cwd=tmp_path) if (argv, msg) == deepest else
                here(*argv, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd))
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert msg in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])


def test_explicit_argv_still_raises_unless_asked(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["eval", "position-loss", "--model", "tiny:llama", "--data", str(tmp_path / "missing.jsonl")])
    assert main(["eval", "position-loss", "--model", "tiny:llama", "--data", str(tmp_path / "missing.jsonl")],
                catch=True) == 2


@pytest.mark.parametrize("argv, dest, want", [
    (["train", "r.yaml", "--nproc", "2", "train.steps=1"], "overrides", ["train.steps=1"]),
    (["train", "r.yaml", "a=1", "--nproc", "2", "b=2", "--print", "c=3"], "overrides", ["a=1", "b=2", "c=3"]),
    (["data", "prepare", "a.jsonl", "--out", "rows.jsonl", "b.jsonl", "--task", "qa", "c/"], "inputs",
     ["a.jsonl", "b.jsonl", "c/"]),
    (["bench", "attention", "--quick", "hybrid"], "sections", ["attention", "hybrid"]),
    (["eval", "compare", "base", "--cp", "2", "tuned"], "b", "tuned"),
])
def test_options_may_come_anywhere_among_the_positionals(argv, dest, want):
    """`longdoc train recipe.yaml --nproc 2 train.steps=1` said "unrecognized arguments: train.steps=1"."""
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == want


def test_intermixed_parsing_still_refuses_what_it_should(capsys):
    parser = build_parser()
    for argv, says in ((["train", "r.yaml", "--bogus", "x=1"], "unrecognized arguments: --bogus"),
                       (["train", "r.yaml", "x=1", "--nproc"], "argument --nproc: expected one argument"),
                       (["train", "--nproc", "2"], "the following arguments are required: recipe")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
    args = parser.parse_args(["train", "r.yaml", "--nproc", "2"])
    assert (args.recipe, args.overrides, args.nproc) == ("r.yaml", [], 2)
