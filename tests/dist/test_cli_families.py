"""The families the README lists for sliding windows, sinks and soft-capping, through the command line at cp=2:
`longdoc verify` on the tiny configs (PASS, and it names the patterns it exercised), then `longdoc train` (its
own 2 local ranks), `verify` of the saved folder and `eval` of it at cp=2 against cp=1. GPT-OSS and Gemma 2 load
with eager attention (their classes refuse sdpa); the patch replaces it either way."""

from __future__ import annotations

import json

import pytest

from longdoc.cli import main

COMMON = ["--threads", "1", "--timeout", "120"]


@pytest.mark.parametrize("arch, patterns", [
    ("gpt_oss", ["sliding window 32 (1 of 2 layers)", "full causal (1 of 2 layers)", "attention sinks (2 of 2"]),
    ("gemma2", ["sliding window 32 (1 of 2 layers)", "logit soft-capping 5 (2 of 2 layers)"]),
])
def test_verify_tiny_family_passes_and_names_its_patterns(arch, patterns, capsys):
    rc = main(["verify", "--model", f"tiny:{arch}", "--cp", "2", "--seq-len", "101", *COMMON])
    out = capsys.readouterr().out
    assert rc == 0 and f"PASS: tiny:{arch}" in out, out
    line = next(x for x in out.splitlines() if x.startswith("attention patterns exercised:"))
    for p in [*patterns, "padding (3 tokens"]:  # 101 -> 104, the zigzag multiple at cp=2
        assert p in line, line


@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_train_verify_and_eval_a_saved_family_model_at_cp2(arch, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("{}\n")
    out = tmp_path / "run"
    rc = main(["train", str(recipe), f"output_dir={out}", f"model.name=tiny:{arch}", "parallelism.cp_size=2",
               "data.path=random", "data.seq_len=96", "data.random_size=4", "train.steps=2", "train.batch_size=2",
               "lora.enabled=false", 'train.mixed_precision="no"', "log.progress=false", "log.tensorboard=false",
               "log.plot=false"])
    printed = capsys.readouterr().out
    assert rc == 0 and "no launcher: starting 2 local CPU processes" in printed, printed
    final = out / "final"
    assert (final / "model.safetensors").is_file()

    assert main(["verify", "--model", str(final), "--cp", "2", "--seq-len", "80", *COMMON]) == 0
    assert f"PASS: {final}" in capsys.readouterr().out

    docs = tmp_path / "docs.jsonl"
    words = " ".join(f"clause {i} of the agreement binds party {i % 7}." for i in range(60))
    docs.write_text(json.dumps({"text": words}) + "\n")
    losses = {}
    for cp in ("1", "2"):
        report = tmp_path / f"eval-cp{cp}"
        assert main(["eval", "position-loss", "--model", str(final), "--data", str(docs), "--length", "256",
                     "--buckets", "4", "--cp", cp, "--out", str(report), *COMMON]) == 0
        assert "position-loss: mean loss" in capsys.readouterr().out  # the headline, not only the path
        losses[cp] = json.loads((report / "results.json").read_text())["mean_loss"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["2"], losses["1"], strict=True)), losses
