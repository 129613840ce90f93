"""Document-QA prompts for evaluation: the training format, split into a document prefix and a question suffix.

The ids are those `longdoc data prepare --task qa` trains on (`longdoc.corpus.qa_format.qa_parts`: the
chat template's user turn holds a brief-answer instruction, the document, then the question; a plain
"Question: ... Answer:" layout for models without a template), so a fine-tuned model is evaluated on
the prompt it learned. The document is tokenized on its own, as in training; one prefill of
`prefix(document)` serves every `suffix(question)` about it, and a single-process reference that uses
the same ids sees the same prompt.
"""

from __future__ import annotations

from typing import Any

from longdoc.corpus.qa_format import INSTRUCTION, qa_parts

__all__ = ["INSTRUCTION", "Prompter"]


class Prompter:
    """Builds (prefix ids, suffix ids) for a document and a question with one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer.
        chat: use the tokenizer's chat template; None = when it has one.
    """

    def __init__(self, tokenizer: Any, chat: bool | None = None):
        self.tok = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat and not has_template:
            raise ValueError("chat=True but the tokenizer has no chat template; pass chat=False (plain-text prompt)")
        self.chat = has_template if chat is None else chat
        self._head = qa_parts(tokenizer, "", use_chat_template=self.chat).prefix

    def prefix(self, document: str) -> list[int]:
        """Ids of everything up to the end of the document (independent of the question)."""
        return self._head + list(self.tok(document, add_special_tokens=False, verbose=False)["input_ids"])

    def suffix(self, question: str) -> list[int]:
        """Ids of the question and what follows it, up to where the answer starts."""
        return qa_parts(self.tok, question.strip(), use_chat_template=self.chat).suffix

    def answer(self, text: str) -> list[int]:
        """Ids of an answer as trained on (for teacher-forced scoring): the answer text and the end of the
        answer turn (end-of-turn / EOS token), so scoring also rewards stopping after the answer."""
        return qa_parts(self.tok, "", text.strip(), use_chat_template=self.chat).answer

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
