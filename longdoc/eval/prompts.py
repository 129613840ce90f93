"""Document-QA prompts, tokenized as a shared document prefix plus a per-question suffix.

The prompt is "instruction, document, question" in the model's chat template (a plain-text layout for
models without one). It is tokenized in two pieces, cut just before the question, so that one
prefill of the document serves every question about it: the ids are exactly prefix + suffix, and a
single-process reference that uses the same ids sees the same prompt.
"""

from __future__ import annotations

from typing import Any

INSTRUCTION = ("Read the document below and answer the question after it. Answer with the exact words from "
               "the document, as briefly as possible (a name, a number, a date, a short phrase), with no "
               "explanation.")
_MARK = "<<<longdoc-question>>>"


class Prompter:
    """Builds (prefix ids, suffix ids) for a document and a question with one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer.
        chat: use the tokenizer's chat template; None = when it has one.
        instruction: the task instruction placed before the document.
    """

    def __init__(self, tokenizer: Any, chat: bool | None = None, instruction: str = INSTRUCTION):
        self.tok = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat and not has_template:
            raise ValueError("chat=True but the tokenizer has no chat template; pass chat=False (plain-text prompt)")
        self.chat = has_template if chat is None else chat
        self.instruction = instruction
        self._head, self._tail = self._layout()

    def _layout(self) -> tuple[str, str]:
        """(text before the document, text after the question) around the placeholders."""
        content = f"{self.instruction}\n\n{{document}}\n\nQuestion:{_MARK}"
        if self.chat:
            text = self.tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
            if _MARK not in text or "{document}" not in text:
                raise ValueError("the chat template rewrites the message text; pass chat=False")
        else:
            text = content + "\nAnswer:"
        head, rest = text.split("{document}", 1)
        middle, tail = rest.split(_MARK, 1)
        return head, middle + "\x00" + tail  # \x00 marks where the question goes inside the suffix

    def _encode(self, text: str, first: bool) -> list[int]:
        # A chat template spells its special tokens (and BOS, if any) as text; a plain prompt needs the
        # tokenizer's own BOS at the very start.
        special = first and not self.chat
        return list(self.tok(text, add_special_tokens=special, verbose=False)["input_ids"])

    def prefix(self, document: str) -> list[int]:
        """Ids of everything up to and including "Question:" (the question's leading space starts the
        suffix, so BPE merges it with the first word as in a prompt tokenized whole)."""
        middle = self._tail.split("\x00", 1)[0]
        return self._encode(self._head + document + middle, first=True)

    def suffix(self, question: str) -> list[int]:
        """Ids of the question and what follows it, up to where the answer starts."""
        return self._encode(" " + question.strip() + self._tail.split("\x00", 1)[1], first=False)

    def answer(self, text: str) -> list[int]:
        """Ids of an answer written right after the prompt (for teacher-forced scoring)."""
        return self._encode(text, first=False)

    def stop_ids(self) -> list[int]:
        """Token ids that end an answer: EOS, and the chat template's end-of-turn token."""
        ids = set()
        if self.tok.eos_token_id is not None:
            ids.add(int(self.tok.eos_token_id))
        for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>"):
            tid = self.tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(self.tok, "unk_token_id", None) and tid >= 0:
                ids.add(tid)
        return sorted(ids)

    def decode_answer(self, ids: list[int]) -> str:
        """The generated answer as text: up to the first stop token, first non-empty line, stripped."""
        stops = set(self.stop_ids())
        cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        text = self.tok.decode(ids[:cut], skip_special_tokens=True)
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        return lines[0] if lines else ""
