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
