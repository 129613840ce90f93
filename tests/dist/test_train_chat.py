"""`data.task: chat` trains at cp=2 exactly as one process. Fast: raw conversations through `longdoc train`'s
data path, a long document in a user turn (cut to data.seq_len, the answer kept) among packed short conversations
(ShareGPT and OpenAI style), the loss on the assistant turns, a held-out chat loss every step: each step's loss,
loss-token count, grad norm and the reduced gradient of every parameter equal one process's, the cp=2 run pinned to the
one-process run's parameters after each step (tests/support/training.py: train_pinned), so step k's gradients are taken
at identical parameters. Slow (`make test-slow`): the all-token loss with right truncation likewise, CPTrainer on
prepared chat rows (float64 tiny model, logged losses, grad norms and final weights), and `eval chat-loss`."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.chat_cases import chat_cases
from tests.support.training import assert_steps_equal, max_rel_err, ranks, tiny_recipe, train_pinned

REL = 1e-5
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


def _write(tmp_path) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _conversations()))
    return str(path)


def _recipe(out, path: str, **data) -> dict:
    # the default tokenizer's vocabulary (tied: one 49152 x 64 matrix to record per step, not two)
    return tiny_recipe(out, model={"name": "tiny:llama", "overrides": {"tie_word_embeddings": True}},
                       eval={"holdout": 2, "every": 1}, data={"path": path, "task": "chat", "seq_len": 256, **data})


def _val_losses(out) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def _pinned_cp2_equals_one_process(tmp_path, path: str, tag: str, **data) -> None:
    ref, ref_grads, pin = ranks(1, train_pinned, _recipe(tmp_path / f"{tag}-1", path, **data), [],
                                deadline=600)[0]
    cp2 = ranks(2, train_pinned, _recipe(tmp_path / f"{tag}-2", path, **data), ["parallelism.cp_size=2"], pin,
                deadline=600)
    assert len(ref) == 3 and all(tokens > 0 for _, _, tokens, _ in ref)
    assert_steps_equal(ref, ref_grads, cp2, tag, rel=REL)
    # the held-out chat loss, after each step's update (at the pinned parameters but the last)
    one, two = _val_losses(tmp_path / f"{tag}-1"), _val_losses(tmp_path / f"{tag}-2")
    assert [s for s, _ in one] == [s for s, _ in two] == [1, 2, 3]
    for (_, a), (_, b) in zip(two, one, strict=True):
        assert a == pytest.approx(b, rel=REL), (tag, two, one)


def test_chat_with_a_long_document_steps_at_cp2_as_one_process(tmp_path):
    from longdoc.corpus.prepare import prepare
    from longdoc.corpus.tokens import get_tokenizer

    path = _write(tmp_path)
    ds = prepare(path, get_tokenizer(), task="chat", target_tokens=256, pack=True, cache_dir=tmp_path / "cache")
    assert max(ds["cut_tokens"]) > 0 and max(len(c) for c in ds["cu_seqlens"]) > 2  # cut and packed rows
    _pinned_cp2_equals_one_process(tmp_path, path, "assistant-packed", pack=True)


@pytest.mark.slow  # four spawns: about 2 minutes on 2 shared cores
def test_chat_all_tokens_and_cptrainer_cp2_equal_one_process(tmp_path):
    from longdoc.corpus.prepare import prepare
    from longdoc.corpus.tokens import get_tokenizer

    path = _write(tmp_path)
    _pinned_cp2_equals_one_process(tmp_path, path, "all-right", chat_loss="all", truncation="right")
    ds = prepare(path, get_tokenizer(), task="chat", target_tokens=256, pack=True, cache_dir=tmp_path / "cache")
    rows = [{k: r[k] for k in ("input_ids", "labels", "position_ids")} for r in ds]
    want = ranks(1, chat_cases, {}, [], rows, str(tmp_path / "t1"), deadline=600)[0]["cptrainer"]
    for result in ranks(2, chat_cases, {}, [], rows, str(tmp_path / "t2"), deadline=600):
        got = result["cptrainer"]
        assert len(got["logs"]) == len(want["logs"]) == 3
        for (step, loss, norm), (rstep, rloss, rnorm) in zip(got["logs"], want["logs"], strict=True):
            assert step == rstep and abs(loss - rloss) <= REL * abs(rloss) and abs(norm - rnorm) <= REL * abs(rnorm)
        tensors = [{k: torch.from_numpy(v) for k, v in w.items()} for w in (got["weights"], want["weights"])]
        assert max_rel_err(*tensors) <= REL


@pytest.mark.slow
def test_eval_chat_loss_cp2_equals_cp1(tmp_path):
    from longdoc.cli import main
    from longdoc.eval import report

    path = _write(tmp_path)
    common = ["eval", "chat-loss", "--model", "tiny:llama", "--data", path, "--length", "256", "--threads", "1"]
    assert main(common + ["--out", str(tmp_path / "cp1")]) == 0
    assert main(common + ["--cp", "2", "--out", str(tmp_path / "cp2")]) == 0
    one, two = report.load_results(tmp_path / "cp1"), report.load_results(tmp_path / "cp2")
    assert one["tokens"] == two["tokens"] > 0 and one["conversations"] == two["conversations"] == 10
    assert abs(one["overall"] - two["overall"]) <= 1e-5 * one["overall"]
