"""Multi-question QA rows: one document, several question/answer turns, loss on every answer, the evidence
of every included question kept, the order shuffled per seed and epoch, and the first turn identical to the
evaluation prompt."""

from __future__ import annotations

import pytest

from longdoc.corpus.prepare import prepare
from longdoc.corpus.qa_format import INSTRUCTION, qa_turns
from longdoc.corpus.synth import synthesize, write_jsonl
from longdoc.corpus.tokens import get_tokenizer
from longdoc.corpus.windows import IGNORE
from longdoc.eval.prompts import Prompter


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def synth(tmp_path_factory, tok):
    records = synthesize("legal", 2, 4096, seed=5, tokenizer=tok)
    path = tmp_path_factory.mktemp("synth") / "docs.jsonl"
    write_jsonl(records, path)
    return path, records


def _answers(row: dict) -> list[list[int]]:
    """The runs of loss tokens of a row, in order."""
    runs, cur = [], []
    for x in row["labels"]:
        if x == IGNORE:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(x)
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("target", [1536, 4800])
def test_rows_hold_many_questions_with_their_evidence(synth, tok, tmp_path, target):
    path, records = synth
    ds = prepare(str(path), tok, task="qa", target_tokens=target, cache_dir=tmp_path)
    qas = {q["id"]: q for r in records for q in r["qa"]}
    assert sorted(i for ids in ds["qa_ids"] for i in ids) == sorted(qas), "every question exactly once"
    assert max(len(ids) for ids in ds["qa_ids"]) > 1, "default: as many questions per row as fit"
    if target == 4800:  # the whole 4k document and all its 15 questions fit: one row per document
        assert len(ds) == len(records) and all(len(p) == 1 for p in ds["doc_pieces"])
    for row in ds:
        assert row["num_tokens"] <= target and row["qa_id"] == row["qa_ids"][0]
        text = tok.decode(row["input_ids"])
        for qa_id, kind in zip(row["qa_ids"], row["kinds"]):
            q = qas[qa_id]
            assert q["kind"] == kind and q["question"] in text
            for ev in q["evidence"]:
                assert ev["text"] in text, (qa_id, ev["text"])
        answers = [tok.decode(a) for a in _answers(row)]
        assert answers == [qas[i]["answer"] + "<|im_end|>" for i in row["qa_ids"]], "loss on every answer only"
        assert row["num_loss_tokens"] == sum(len(a) for a in _answers(row))


def test_questions_per_row_caps_the_turns(synth, tok, tmp_path):
    path, records = synth
    ds = prepare(str(path), tok, task="qa", target_tokens=4800, cache_dir=tmp_path, questions_per_row=4)
    per_doc = {r["id"]: len(r["qa"]) for r in records}
    assert all(len(ids) <= 4 for ids in ds["qa_ids"])
    for doc_id, n in per_doc.items():
        assert sum(len(r["qa_ids"]) for r in ds if r["doc_ids"] == [doc_id]) == n
        assert sum(1 for r in ds if r["doc_ids"] == [doc_id]) == -(-n // 4)
    with pytest.raises(ValueError, match="questions_per_row must be >= 1"):
        prepare(str(path), tok, task="qa", target_tokens=4800, cache_dir=tmp_path, questions_per_row=0)


def test_question_order_is_shuffled_per_seed_and_epoch(synth, tok, tmp_path):
    path, records = synth

    def orders(seed: int, epochs: int) -> dict[tuple[str, int], list[str]]:
        ds = prepare(str(path), tok, task="qa", target_tokens=4800, cache_dir=tmp_path, seed=seed, epochs=epochs)
        return {(r["doc_ids"][0], r["epoch"]): r["qa_ids"] for r in ds}

    two = orders(0, 2)
    assert sorted(two) == sorted((r["id"], e) for r in records for e in (0, 1))
    for r in records:
        first, second = two[(r["id"], 0)], two[(r["id"], 1)]
        assert sorted(first) == sorted(second) == sorted(q["id"] for q in r["qa"]), "each epoch: every question"
        assert first != second, "a new order every epoch"
        assert first != [q["id"] for q in r["qa"]], "shuffled, not the file's order"
    assert orders(0, 1) == {k: v for k, v in two.items() if k[1] == 0}, "epoch e's order does not depend on epochs"
    other = orders(1, 1)
    assert any(other[(r["id"], 0)] != two[(r["id"], 0)] for r in records), "the seed changes the order"


@pytest.mark.parametrize("chat", [True, False])
def test_first_turn_is_the_evaluation_prompt(tok, tmp_path, chat):
    doc = "The hearing was held on March 3, 2021 before Judge Ann Lee. The fee was $1,200.00 in total."
    qa = [{"question": "When was the hearing held?", "answer": "March 3, 2021"},
          {"question": "Who was the judge?", "answer": "Judge Ann Lee"},
          {"question": "What was the fee?", "answer": "$1,200.00"}]
    (row,) = prepare([{"id": "d", "document": doc, "qa": qa}], tok, task="qa", target_tokens=512,
                     cache_dir=tmp_path, use_chat_template=chat)
    first = qa[int(row["qa_ids"][0].split("#")[1])]
    p = Prompter(tok, chat=chat)
    prompt = p.prefix(doc) + p.suffix(first["question"])
    assert row["input_ids"][:len(prompt)] == prompt, "training's first turn == evaluation's prompt, id for id"
    answer = p.answer(first["answer"])
    assert row["input_ids"][len(prompt):len(prompt) + len(answer)] == answer
    assert row["labels"][len(prompt):len(prompt) + len(answer)] == answer
    assert all(x == IGNORE for x in row["labels"][:len(prompt)])
    order = [qa[int(i.split("#")[1])] for i in row["qa_ids"]]
    if chat:  # the whole row is the chat template's own multi-turn conversation
        msgs = [{"role": "user", "content": f"{INSTRUCTION}\n\n{doc}\n\nQuestion: {order[0]['question']}"}]
        for k, q in enumerate(order):
            msgs += ([{"role": "user", "content": f"Question: {q['question']}"}] if k else []) + \
                [{"role": "assistant", "content": q["answer"]}]
        assert tok.decode(row["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False).rstrip()
    else:
        body = "".join(f"\n\nQuestion: {q['question']}\nAnswer: {q['answer']}{tok.eos_token}" for q in order)
        assert tok.decode(row["input_ids"], skip_special_tokens=False) == doc + body


def test_qa_turns_needs_a_question(tok):
    with pytest.raises(ValueError, match="at least one"):
        qa_turns(tok, [])


def test_training_prepares_a_pass_per_epoch_it_consumes(synth, tok):
    from longdoc.train.config import DataConfig
    from longdoc.train.data import load_sequences

    path, records = synth
    cfg = DataConfig(path=str(path), task="qa", seq_len=4800)
    one = load_sequences(cfg, tok, len(tok), seed=0)
    assert len(one) == len(records), "all of a document's questions in one row"
    three = load_sequences(cfg, tok, len(tok), seed=0, rows_needed=5)  # 5 rows of 2 per pass: 3 passes
    assert len(three) == 3 * len(records)
    rows = [three.row(i) for i in range(len(three))]
    assert len({tuple(ids.tolist()) for ids, _ in rows}) == len(rows), "each pass asks in another order"
    answers = [int((y != IGNORE).sum()) for _, y in rows]
    assert sorted(answers) == sorted(3 * [int((one.row(i)[1] != IGNORE).sum()) for i in range(len(one))]), \
        "every pass trains the same answers"
