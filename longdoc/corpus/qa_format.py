"""How a document question becomes tokens: the prompt around the document and the answer target.

Training (`prepare --task qa`) and evaluation use this one function, so they format alike:

    parts = qa_parts(tokenizer, "What was the potassium on 03/14/2023, in mmol/L?", "5.8")
    ids = parts.prefix + document_ids + parts.suffix + parts.answer    # loss on parts.answer only

With a chat template: one user turn holding an instruction, the document, then the question; the
assistant turn is the answer (the template's end-of-turn token included). Without one: plain text
"<document>\\n\\nQuestion: ...\\nAnswer:" followed by " <answer><eos>", after the tokenizer's BOS
when it adds one by default (a chat template spells its own special tokens).

The document is tokenized on its own and placed between `prefix` and `suffix`; the question lives in the
suffix only, so evaluation prefills one document once and asks every question about it
(`longdoc.eval.prompts.Prompter`).

Several questions about one document in one training row (`qa_turns`): the first turn is exactly
`qa_parts` (so the first question of a row is the evaluation prompt, id for id); every later question
is a further user turn of the same conversation (chat template) or a further "Question: ... Answer:"
block (plain text), each followed by its answer:

    prefix, turns = qa_turns(tokenizer, [(q1, a1), (q2, a2)])
    ids = prefix + document_ids + turns[0].prompt + turns[0].answer + turns[1].prompt + turns[1].answer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INSTRUCTION = ("Read the document below and answer the question after it. Answer with the exact words from the "
               "document, as briefly as possible (a name, a number, a date, a short phrase), with no explanation.")
_DOC = "\u2063LONGDOC_DOCUMENT\u2063"


@dataclass(frozen=True)
class QAParts:
    prefix: list[int]  # before the document
    suffix: list[int]  # after the document: the question and the start of the answer turn
    answer: list[int]  # the target (empty when no answer was given)


def qa_parts(tokenizer: Any, question: str, answer: str | None = None, system: str | None = None,
             use_chat_template: bool | None = None) -> QAParts:
    """Token ids around a document for one question (`use_chat_template=None`: when the tokenizer has one)."""
    user = f"{INSTRUCTION}\n\n{_DOC}\n\nQuestion: {question}"
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        target = ""
        if answer is not None:
            full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": answer}], tokenize=False)
            if not full.startswith(prompt):
                raise ValueError("the chat template does not extend the prompt with the answer turn; "
                                 "use use_chat_template=False (plain text format) for this tokenizer")
            target = full[len(prompt):].rstrip()
    else:
        prompt = (f"{system}\n\n" if system else "") + user.replace(f"{INSTRUCTION}\n\n", "") + "\nAnswer:"
        target = "" if answer is None else f" {answer}" + (tokenizer.eos_token or "")
    if prompt.count(_DOC) != 1:
        raise ValueError("the chat template altered the document placeholder; cannot place the document")
    before, after = prompt.split(_DOC)

    def enc(text: str, special: bool = False) -> list[int]:
        return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]) if text or special else []

    return QAParts(enc(before, special=not use_chat_template), enc(after), enc(target))


@dataclass(frozen=True)
class Turn:
    prompt: list[int]  # from the end of the previous answer (or of the document) to where this answer starts
    answer: list[int]  # the target


def qa_turns(tokenizer: Any, qas: list[tuple[str, str]], system: str | None = None,
             use_chat_template: bool | None = None) -> tuple[list[int], list[Turn]]:
    """(prefix ids, one Turn per (question, answer)) of a multi-question conversation about one document."""
    if not qas:
        raise ValueError("qa_turns needs at least one (question, answer) pair")
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    first = qa_parts(tokenizer, qas[0][0], qas[0][1], system=system, use_chat_template=use_chat_template)
    turns = [Turn(first.suffix, first.answer)]
    if len(qas) == 1:
        return first.prefix, turns

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []

    if not use_chat_template:
        eos = tokenizer.eos_token or ""
        return first.prefix, turns + [Turn(enc(f"\n\nQuestion: {q}\nAnswer:"), enc(f" {a}{eos}")) for q, a in qas[1:]]
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": f"{INSTRUCTION}\n\n{_DOC}\n\nQuestion: {qas[0][0]}"},
         {"role": "assistant", "content": qas[0][1]}]
    # The text so far, up to the end of the last answer as trained on (qa_parts strips the template's trailing
    # newline from the answer turn; that newline then opens the next turn).
    done = tokenizer.apply_chat_template(msgs, tokenize=False).rstrip()
    for q, a in qas[1:]:
        msgs.append({"role": "user", "content": f"Question: {q}"})
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        msgs.append({"role": "assistant", "content": a})
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ValueError("the chat template rewrites earlier turns of a conversation; prepare one question "
                             "per row (questions_per_row=1) or use the plain text format (use_chat_template=False)")
        target = full[len(prompt):].rstrip()
        turns.append(Turn(enc(prompt[len(done):]), enc(target)))
        done = prompt + target
    return first.prefix, turns
