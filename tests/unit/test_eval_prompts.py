"""QA prompts split into a shared document prefix + question suffix, answer decoding, needle planting."""

from __future__ import annotations

import pytest

from longdoc.corpus.qa_format import qa_parts
from longdoc.eval.needle import GROUP_TOKENS, groups, plant
from longdoc.eval.prompts import INSTRUCTION, Prompter
from longdoc.models import load_tokenizer

DOC = "CASE FILE 12-CV-0042\n\nThe hearing was held on March 3, 2021. Counsel appeared.\nThe motion was denied."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_chat_prompt_is_prefix_plus_suffix(tok):
    p = Prompter(tok)
    assert p.chat
    q = "When was the hearing held?"
    ids = p.prefix(DOC) + p.suffix(q)
    whole = tok.apply_chat_template([{"role": "user", "content": f"{INSTRUCTION}\n\n{DOC}\n\nQuestion: {q}"}],
                                    tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == whole
    # The document prefix does not depend on the question: one prefill serves them all.
    assert p.prefix(DOC) == Prompter(tok).prefix(DOC)
    assert tok.decode(p.suffix("Who appeared?")).startswith("\n\nQuestion: Who appeared?<|im_end|>")
    assert tok.decode(p.answer("March 3, 2021")) == "March 3, 2021<|im_end|>"
    assert 2 in p.stop_ids()  # <|im_end|>


def test_prompt_is_the_training_format(tok):
    """Evaluation asks exactly what `prepare --task qa` trains on: same ids around the same document ids."""
    q, a = "When was the hearing held?", "March 3, 2021"
    for chat in (True, False):
        parts = qa_parts(tok, q, a, use_chat_template=chat)
        doc_ids = tok(DOC, add_special_tokens=False)["input_ids"]
        p = Prompter(tok, chat=chat)
        assert p.prefix(DOC) + p.suffix(q) + p.answer(a) == parts.prefix + doc_ids + parts.suffix + parts.answer


def test_plain_prompt(tok):
    p = Prompter(tok, chat=False)
    text = tok.decode(p.prefix(DOC) + p.suffix("Who appeared?"), skip_special_tokens=True)
    assert text == f"{DOC}\n\nQuestion: Who appeared?\nAnswer:"
    assert tok.decode(p.answer("Counsel")) == " Counsel" + tok.eos_token


def test_decode_answer_stops_and_takes_first_line(tok):
    p = Prompter(tok)
    ids = tok("\n March 3, 2021\nBecause the docket says so", add_special_tokens=False)["input_ids"]
    assert p.decode_answer(ids) == "March 3, 2021"
    assert p.decode_answer(tok("Denied", add_special_tokens=False)["input_ids"] + [2, 500, 600]) == "Denied"
    assert p.decode_answer([2]) == ""


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_plant_puts_the_needle_at_depth(tok, depth):
    hay = " ".join(f"Sentence number {i} of the filler says nothing at all." for i in range(400))
    needle = "The combination of the evidence safe is 48213."
    doc, actual, n = plant(hay, needle, 600, depth, tok)
    assert doc.count(needle) == 1
    assert abs(n - 600) <= 3  # the cut lands on a token boundary
    assert len(tok(doc, add_special_tokens=False)["input_ids"]) == n
    assert abs(actual - depth) < 0.05  # moved back to a sentence boundary at most
    start = doc.index(needle)
    assert start == 0 or doc[start - 1] in " \n"
    if depth == 0.0:
        assert start == 0
    if depth == 1.0:
        assert doc.endswith(needle)
    with pytest.raises(ValueError, match="cannot fit"):
        plant(hay[:200], needle, 600, depth, tok)


def test_needle_groups_hold_equal_lengths_in_order_and_capped():
    sizes = [219, 217, 219, 217, 219, 347, 219]
    assert groups(sizes, 8) == [[0, 2, 4, 6], [1, 3], [5]]
    assert groups(sizes, 2) == [[0, 2], [1, 3], [4, 6], [5]]
    assert groups(sizes, 1) == [[k] for k in range(len(sizes))]  # one cell at a time
    # rows x length <= GROUP_TOKENS, one row always
    assert groups([8192] * 6, 8) == [[0, 1, 2, 3], [4, 5]] and GROUP_TOKENS // 8192 == 4
    assert groups([GROUP_TOKENS + 1] * 2, 8) == [[0], [1]]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="--needle-batch must be an integer >= 1"):
            groups(sizes, bad)


def test_needle_batch_option():
    from longdoc.cli import build_parser

    p = build_parser()
    assert p.parse_args(["eval", "needle"]).needle_batch == 8
    assert p.parse_args(["eval", "needle", "--needle-batch", "1"]).needle_batch == 1
    assert p.parse_args(["eval", "compare", "a", "b", "--needle-batch", "3"]).needle_batch == 3
    with pytest.raises(SystemExit):
        p.parse_args(["eval", "needle", "--needle-batch", "0"])
