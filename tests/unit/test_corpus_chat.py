"""`task: chat`: conversations parsed (OpenAI and ShareGPT) with located errors, rendered by the model's chat
template with the loss on assistant turns (equal to a {% generation %} template's assistant mask and to TRL
SFTTrainer's assistant-only loss), truncated without cutting a trained turn, packed, prepared and reported."""

from __future__ import annotations

import json

import pytest
import torch

from longdoc.corpus import chat
from longdoc.corpus.ingest import CorpusError, Skips, read_documents
from longdoc.corpus.prepare import prepare
from longdoc.corpus.tokens import get_tokenizer
from longdoc.corpus.windows import IGNORE

# SmolLM2's own template with {% generation %} around each assistant turn's content and end-of-turn token
# (what transformers' return_assistant_tokens_mask and TRL's assistant_only_loss read); renders the same text.
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

DOC = " ".join(f"Clause {i}: the tenant shall pay rent on day {i % 28 + 1}." for i in range(40))
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": f"Here is the lease:\n\n{DOC}\n\nWhen is rent due under clause 3?"},
     {"role": "assistant", "content": "On day 4."},
     {"role": "user", "content": "And clause 30?"},
     {"role": "assistant", "content": "On day 3."}],
    [{"role": "user", "content": "user"}, {"role": "assistant", "content": "assistant"}],  # content = role names
]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def gen_tok():
    t = get_tokenizer()
    t.chat_template = GENERATION_TEMPLATE
    return t


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


# ------------------------------------------------------------------------------------------- parsing
def test_openai_and_sharegpt_parse_alike(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [
        {"id": "o", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                 {"role": "assistant", "content": [{"type": "text", "text": "A"}]}]},
        {"id": "s", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                      {"from": "gpt", "value": "A"}]}])
    recs = list(read_documents([path], task="chat"))
    assert [r["doc_id"] for r in recs] == ["o", "s"] and recs[0]["source"] == f"{path}:1"
    assert recs[0]["messages"] == recs[1]["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


BAD = [
    ({"text": "no conversation"}, "record has neither 'messages' nor 'conversations'", "missing field"),
    ({"messages": []}, "field .messages. must be a non-empty list", "wrong field type"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]: role 'bot' is not one of", "unknown role"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "model", "value": "a"}]},
     r"conversations\[1\]: from 'model'", "unknown role"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\]\.content must be a string", "wrong field type"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages has no assistant turn", "no assistant turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
     r"messages\[1\]: the assistant turn is empty", "empty assistant turn"),
    ({"messages": ["hi", {"role": "assistant", "content": "a"}]}, r"messages\[0\] must be an object", "not an object"),
]


@pytest.mark.parametrize("bad,match,reason", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_conversations_name_file_line_and_skip(tmp_path, bad, match, reason):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = _jsonl(tmp_path / "c.jsonl", [good, bad, good])
    with pytest.raises(CorpusError, match=rf"^{path}:2: {match}"):
        list(read_documents([path], task="chat"))
    skips = Skips()
    assert len(list(read_documents([path], task="chat", skips=skips))) == 2
    assert skips.counts == {reason: 1} and f"{path}:2" in skips.summary()


# ----------------------------------------------------------------------------------------- rendering
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["one-turn", "document-two-answers", "role-names"])
def test_assistant_mask_equals_the_generation_template_mask(tok, gen_tok, conv):
    """The prefix method on SmolLM2's plain template labels exactly the tokens a {% generation %} template
    marks: every assistant turn's content and its <|im_end|>, nothing else."""
    r = chat.render(tok, conv)
    ref = gen_tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    plain = tok.apply_chat_template(conv, tokenize=True, return_dict=True)
    assert r.ids == list(ref["input_ids"]) == list(plain["input_ids"])
    assert [x != IGNORE for x in r.labels] == [bool(m) for m in ref["assistant_masks"]]
    trained = tok.decode([x for x in r.labels if x != IGNORE])
    assert trained == "".join(m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant")
    assert chat.render(gen_tok, conv).labels == r.labels  # the generation template renders the same text
    every = chat.render(tok, conv, loss_on="all")
    assert every.labels == every.ids == r.ids


def test_parts_count_every_token(tok):
    conv = CONVERSATIONS[1]
    r = chat.render(tok, conv)
    system, user, assistant, template, cut = r.parts()
    assert system + user + assistant + template == len(r.ids) and cut == 0
    assert system == len(tok("Answer briefly.", add_special_tokens=False)["input_ids"])
    assert assistant == sum(len(tok(m["content"], add_special_tokens=False)["input_ids"])
                            for m in conv if m["role"] == "assistant")
    assert user > len(tok(DOC, add_special_tokens=False)["input_ids"])
    # without a system turn SmolLM2's template adds its default system prompt: template overhead
    assert chat.render(tok, CONVERSATIONS[0]).parts()[0] == 0


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    t = get_tokenizer()
    t.chat_template = "{{ messages | length }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        chat.render(t, CONVERSATIONS[0])
    t.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        chat.render(t, CONVERSATIONS[0])


# ---------------------------------------------------------------------------------------- truncation
@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_cuts_the_document_never_a_trained_turn(tok, side):
    conv = CONVERSATIONS[1]
    full = chat.render(tok, conv)
    target = len(full.ids) - 100
    row = chat.chat_row(tok, conv, target, truncation=side, doc_id="d", source="f:1")
    assert not row["error"] and len(row["input_ids"]) == target
    assert row["labels"] and [x for x in row["labels"] if x != IGNORE] == [x for x in full.labels if x != IGNORE]
    assert row["chat_parts"][0][4] == 100 and sum(row["chat_parts"][0][:4]) == target
    text = tok.decode(row["input_ids"])
    assert "Answer briefly." in text and "And clause 30?" in text  # only the longest turn (the lease) lost tokens
    kept_start, kept_end = "Here is the lease" in text, "When is rent due under clause 3?" in text
    assert (kept_start, kept_end) == ((False, True) if side == "left" else (True, False))
    assert row["position_ids"] == list(range(target)) and row["cu_seqlens"] == [0, target]


def test_conversation_whose_trained_turns_cannot_fit_is_reported(tok):
    conv = [{"role": "user", "content": "Summarise."}, {"role": "assistant", "content": DOC}]
    row = chat.chat_row(tok, conv, 64, doc_id="d", source="f.jsonl:7")
    assert row["input_ids"] == [] and row["error"].startswith("f.jsonl:7: the trained assistant turn(s)")
    assert "more than the target of 64" in row["error"]
    # loss on every token protects only the last assistant turn: an earlier one can be cut
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": DOC},
           {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    assert chat.chat_row(tok, two, 64, loss_on="all")["error"] == ""
    assert chat.chat_row(tok, two, 64)["error"]


# ------------------------------------------------------------------------------ packing and prepare
def test_prepare_packs_conversations_and_reports_parts(tmp_path, tok):
    records = [{"id": f"c{i}", "messages": CONVERSATIONS[i % 3]} for i in range(6)]
    path = _jsonl(tmp_path / "c.jsonl", records)
    one = prepare(path, tok, task="chat", target_tokens=1024, cache_dir=tmp_path / "cache")
    packed = prepare(path, tok, task="chat", target_tokens=1024, pack=True, cache_dir=tmp_path / "cache")
    assert len(one) == 6 and len(packed) < 6
    assert [d for r in packed["doc_ids"] for d in r] == [f"c{i}" for i in range(6)]
    alone = {r["doc_ids"][0]: r for r in one}
    for row in packed:
        cuts = row["cu_seqlens"]
        assert row["num_tokens"] == cuts[-1] <= 1024
        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            ref = alone[row["doc_ids"][k]]
            assert row["input_ids"][a:b] == ref["input_ids"] and row["position_ids"][a:b] == list(range(b - a))
            assert row["labels"][a + 1:b] == ref["labels"][1:]
        for j, name in enumerate(chat.PARTS):
            assert row[f"{name}_tokens"] == sum(p[j] for p in row["chat_parts"])
    assert sum(packed["num_loss_tokens"]) == sum(one["num_loss_tokens"])
    line = chat.parts_summary(packed.to_dict())
    assert line.startswith("chat: 6 conversations; tokens by part: system ") and "template" in line


def test_prepare_cli_reports_parts_and_skips(tmp_path, capsys):
    from longdoc.cli import main

    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "x"}]},
                                         {"messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": DOC}]}])
    out = tmp_path / "rows.jsonl"
    args = ["data", "prepare", path, "--task", "chat", "--target-tokens", "128", "--out", str(out),
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args, catch=True) == 2
    assert f"{path}:2: messages[0]: role 'x'" in capsys.readouterr().err
    assert main(args + ["--skip-bad", "--loss-on", "all"], catch=True) == 0
    captured = capsys.readouterr()
    assert "chat: 1 conversations; tokens by part:" in captured.out
    assert "1 unknown role" in captured.err and "1 conversation does not fit" in captured.err
    row = json.loads(out.read_text().splitlines()[0])
    assert row["labels"] == row["input_ids"]


def test_collate_pads_and_keeps_packed_positions(tmp_path, tok):
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[2]}])
    rows = prepare(path, tok, task="chat", target_tokens=512, pack=True, cache_dir=tmp_path / "cache")
    plain = prepare(path, tok, task="chat", target_tokens=512, cache_dir=tmp_path / "cache")
    b = chat.collate([rows[0]])
    assert b["position_ids"].tolist()[0] == rows[0]["position_ids"]
    b = chat.collate(list(plain))
    assert "position_ids" not in b and b["labels"].shape == b["input_ids"].shape
    n = plain[1]["num_tokens"]
    assert b["labels"][1, n:].eq(IGNORE).all() and b["input_ids"][1, :n].tolist() == plain[1]["input_ids"]


# ------------------------------------------------------------------------------------------ TRL
def test_assistant_only_loss_equals_trl_sfttrainer(tmp_path, tok, gen_tok):
    """Same rows, same tiny model: TRL SFTTrainer(assistant_only_loss=True) on a {% generation %} template and
    longdoc's chat rows (prefix method on SmolLM2's own template) give the same labels and the same loss."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from longdoc.models import tiny_model

    model = tiny_model("llama", vocab_size=len(tok), dtype=torch.float64)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, max_length=None, report_to=[],
                     bf16=False, use_cpu=True, per_device_train_batch_size=3, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=args, processing_class=gen_tok,
                         train_dataset=Dataset.from_list([{"messages": c} for c in CONVERSATIONS]))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    ours = chat.collate([chat.chat_row(tok, c, 4096) for c in CONVERSATIONS], pad_id=tok.pad_token_id)
    keep = batch["attention_mask"].bool()
    assert torch.equal(batch["input_ids"][keep], ours["input_ids"][keep])
    assert torch.equal(batch["labels"].masked_fill(~keep, IGNORE), ours["labels"])
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, batch)  # TRL's own loss path (its metrics too)
        our_loss = model(input_ids=ours["input_ids"], labels=ours["labels"]).loss
    assert abs(float(trl_loss) - float(our_loss)) <= 1e-10 * abs(float(trl_loss))


# ------------------------------------------------------------------------------------------- eval
def test_eval_chat_loss_is_the_mean_assistant_token_loss(tmp_path, tok):
    """`longdoc eval chat-loss` (cp=1) = the model's own mean cross-entropy over the rows' assistant labels; a
    conversation whose answer cannot fit --length is reported, not scored."""
    from longdoc.cli import main
    from longdoc.eval import report
    from longdoc.eval.runner import load_model

    too_long = [{"role": "user", "content": "Summarise."}, {"role": "assistant", "content": DOC}]
    path = _jsonl(tmp_path / "c.jsonl", [{"id": f"c{i}", "messages": c} for i, c in enumerate(CONVERSATIONS)]
                  + [{"id": "long", "messages": too_long}])
    out = tmp_path / "run"
    assert main(["eval", "chat-loss", "--model", "tiny:llama", "--threads", "1", "--data", path, "--length", "256",
                 "--out", str(out)]) == 0
    res = report.load_results(out)
    assert res["conversations"] == 3 and len(res["skipped"]) == 1 and "long" not in str(res["per_conversation"])
    model, _ = load_model("tiny:llama", {"dtype": "float32", "device": "cpu"}, torch.device("cpu"))
    rows = [chat.chat_row(tok, c, 256) for c in CONVERSATIONS]
    total = n = 0.0
    with torch.no_grad():
        for r in rows:
            ids, labels = torch.tensor([r["input_ids"]]), torch.tensor([r["labels"]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            ce = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum", ignore_index=IGNORE)
            total, n = total + float(ce), n + int((labels[0, 1:] != IGNORE).sum())
    assert res["tokens"] == n and abs(res["overall"] - total / n) <= 1e-4 * total / n
    assert "chat-loss: mean loss" in (out / "summary.md").read_text()


def test_synth_records_become_conversations(tok):
    rec = {"id": "legal-s0-0", "domain": "legal", "document": DOC,
           "qa": [{"question": "When is rent due under clause 3?", "answer": "day 4"},
                  {"question": "And under clause 30?", "answer": "day 3"}]}
    conv = chat.qa_conversation(rec)
    assert conv["id"] == "legal-s0-0" and [m["role"] for m in conv["messages"]] == ["user", "assistant"] * 2
    assert DOC in conv["messages"][0]["content"] and conv["messages"][2]["content"] == "And under clause 30?"
    assert chat.messages_of(conv) == conv["messages"]
    trained = tok.decode([x for x in chat.render(tok, conv["messages"]).labels if x != IGNORE])
    assert trained == "day 4<|im_end|>day 3<|im_end|>"


def test_an_opening_assistant_turn_is_context(tok):
    conv = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Sum 2+2."},
            {"role": "assistant", "content": "4"}]
    assert tok.decode([x for x in chat.render(tok, conv).labels if x != IGNORE]) == "4<|im_end|>"
    with pytest.raises(chat.ChatError, match="no assistant turn after its first message"):
        chat.messages_of({"messages": conv[:2]})
