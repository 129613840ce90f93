"""`data.task: chat` trains at cp=2 exactly as one process: `longdoc train` on raw conversations (a long
document in a user turn, cut to data.seq_len; packed short conversations; assistant-only and all-token loss;
held-out chat loss), and CPTrainer on prepared chat rows. One spawn per world size, every case inside it;
fp32 (longdoc train) and float64 (CPTrainer) tiny models compared at 1e-5. Slow tier: `make test-slow`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.chat_cases import chat_cases
from tests.training import max_rel_err, ranks, tiny_recipe

REL = 1e-5
pytestmark = pytest.mark.slow  # two spawns, three trainings each: about 2 minutes on 2 shared cores
DOC = " ".join(f"Clause {i}: the tenant shall pay rent on day {i % 28 + 1}, late fees {i} percent." for i in range(60))


def _conversations() -> list[dict]:
    convs = []
    for i in range(10):
        if i % 3 == 0:  # a long document in a user turn (cut to data.seq_len, the answer kept)
            msgs = [{"role": "system", "content": "Answer from the lease."},
                    {"role": "user", "content": f"{DOC}\n\nWhen is rent due under clause {i}?"},
                    {"role": "assistant", "content": f"On day {i % 28 + 1}."}]
        else:
            msgs = [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{2 * i}."},
                    {"role": "user", "content": "And times two?"},
                    {"role": "assistant", "content": f"It is {4 * i}, as {2 * i} times two is {4 * i}."}]
        convs.append({"id": f"c{i}", **({"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(
            m["role"], m["role"]), "value": m["content"]} for m in msgs]} if i % 2 else {"messages": msgs})})
    return convs


def _recipes(tmp_path, path: str, tag: str) -> dict:
    model = {"name": "tiny:llama", "overrides": {}}  # the default tokenizer's vocabulary
    ev = {"holdout": 2, "every": 1}  # the held-out chat loss, under CP too
    return {
        "assistant-packed": tiny_recipe(tmp_path / tag / "assistant-packed", model=model, eval=ev,
                                        data={"path": path, "task": "chat", "seq_len": 256, "pack": True}),
        "all-right": tiny_recipe(tmp_path / tag / "all-right", model=model,
                                 data={"path": path, "task": "chat", "seq_len": 256, "chat_loss": "all",
                                       "truncation": "right"}),
    }


def test_chat_cp2_equals_one_process(tmp_path):
    from longdoc.corpus.prepare import prepare
    from longdoc.corpus.tokens import get_tokenizer

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    ds = prepare(str(path), get_tokenizer(), task="chat", target_tokens=256, pack=True, cache_dir=tmp_path / "cache")
    assert max(ds["cut_tokens"]) > 0 and max(len(c) for c in ds["cu_seqlens"]) > 2  # cut and packed rows
    rows = [{k: r[k] for k in ("input_ids", "labels", "position_ids")} for r in ds]
    ref = ranks(1, chat_cases, _recipes(tmp_path, str(path), "cp1"), [], rows, str(tmp_path / "t1"),
                deadline=600)[0]
    cp2 = ranks(2, chat_cases, _recipes(tmp_path, str(path), "cp2"), ["cp_size=2"], rows, str(tmp_path / "t2"),
                deadline=600)
    for name in ("assistant-packed", "all-right"):
        w_ref = load_file(tmp_path / "cp1" / name / "final" / "model.safetensors")
        w_cp2 = load_file(tmp_path / "cp2" / name / "final" / "model.safetensors")
        assert max_rel_err(w_cp2, w_ref) <= REL, name
        assert len(ref[name]) == 3
        for result in cp2:
            for got, want in zip(result[name], ref[name], strict=True):
                assert got[0] == want[0] and got[2] == want[2], (name, got, want)  # step, loss tokens
                for a, b in zip(got[1:], want[1:]):
                    if isinstance(b, float):
                        assert abs(a - b) <= REL * max(1.0, abs(b)), (name, got, want)
    assert all(s[4] is not None for s in ref["assistant-packed"])  # validated on held-out chat rows every step
    want = ref["cptrainer"]
    for result in cp2:
        got = result["cptrainer"]
        assert len(got["logs"]) == len(want["logs"]) == 3
        for (step, loss, norm), (rstep, rloss, rnorm) in zip(got["logs"], want["logs"], strict=True):
            assert step == rstep and abs(loss - rloss) <= REL * abs(rloss) and abs(norm - rnorm) <= REL * abs(rnorm)
        tensors = [{k: torch.from_numpy(v) for k, v in w.items()} for w in (got["weights"], want["weights"])]
        assert max_rel_err(*tensors) <= REL


def test_eval_chat_loss_cp2_equals_cp1(tmp_path):
    from longdoc.cli import main
    from longdoc.eval import report

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    common = ["eval", "chat-loss", "--model", "tiny:llama", "--data", str(path), "--length", "256", "--threads", "1"]
    assert main(common + ["--out", str(tmp_path / "cp1")]) == 0
    assert main(common + ["--cp", "2", "--out", str(tmp_path / "cp2")]) == 0
    one, two = report.load_results(tmp_path / "cp1"), report.load_results(tmp_path / "cp2")
    assert one["tokens"] == two["tokens"] > 0 and one["conversations"] == two["conversations"] == 10
    assert abs(one["overall"] - two["overall"]) <= 1e-5 * one["overall"]
