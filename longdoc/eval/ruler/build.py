"""Token-exact prompts for the RULER-style suite: the task's frame around a context built piece by piece.

A prompt is `frame.before + context + frame.after`: the frame is the task template (in the model's chat
template when it has one) split around the context, and the context is a sequence of pieces (filler
sentences, list entries, documents, needles), each tokenized on its own and concatenated. Because the
pieces are counted in tokens, every prompt of a (task, length) cell has EXACTLY `length - max_new_tokens`
tokens: the prompt and its answer budget fill the length, as RULER counts it, and a cell's prompts batch
without padding. Whole pieces are taken while they fit; the next one is cut at the token where the budget
ends (the context ends mid-sentence, just before the question).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

_CTX = "\u2063LONGDOC_RULER_CONTEXT\u2063"


@dataclass(frozen=True)
class Frame:
    before: list[int]  # from the start of the prompt to the context
    after: list[int]  # from the context to where the answer starts (question, end of turn, answer prefix)


class TooShort(ValueError):
    """The length leaves no room for a context (the frame, an example or the needles take it all)."""


class Builder:
    """Frames and pieces in one tokenizer, with or without its chat template."""

    def __init__(self, tokenizer: Any, chat: bool | None = None):
        self.tok = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat and not has_template:
            raise ValueError("--chat but the tokenizer has no chat template; pass --no-chat (plain-text prompts)")
        self.chat = has_template if chat is None else bool(chat)

    def encode(self, text: str, special: bool = False) -> list[int]:
        if not text and not special:
            return []
        return list(self.tok(text, add_special_tokens=special, verbose=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]]

    def frame(self, template: str, answer_prefix: str) -> Frame:
        """The ids around `{context}` in `template` (the user turn), the answer prefix opening the answer."""
        user = template.replace("{context}", _CTX)
        if user.count(_CTX) != 1:
            raise ValueError("a RULER template must hold {context} exactly once")
        if self.chat:
            prompt = self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                  add_generation_prompt=True)
            # RULER appends the answer prefix to the model's prompt; after a template's "assistant\n" its
            # leading space would be a stray token.
            prompt += answer_prefix.lstrip() if prompt[-1:].isspace() else answer_prefix
        else:
            prompt = user + answer_prefix
        if prompt.count(_CTX) != 1:
            raise ValueError("the chat template altered the context placeholder; use --no-chat")
        before, after = prompt.split(_CTX)
        return Frame(self.encode(before, special=not self.chat), self.encode(after))

    def take(self, pieces: Iterable[str], budget: int, chunk: int = 256, short_ok: bool = False
             ) -> tuple[list[list[int]], list[int]]:
        """(whole pieces that fit in `budget` tokens, the next piece cut to the tokens left). `pieces` must
        run past the budget (an endless generator, or a list made long enough) unless `short_ok`."""
        if budget < 0:
            raise TooShort(f"no room for the context ({budget} tokens)")
        it: Iterator[str] = iter(pieces)
        out: list[list[int]] = []
        used = 0
        while True:
            batch = list(itertools.islice(it, chunk))
            if not batch and short_ok:
                return out, []
            if not batch:
                raise RuntimeError(f"the context pieces ran out after {used} of {budget} tokens (generator bug)")
            for ids in self.encode_many(batch):
                if used + len(ids) > budget:
                    return out, ids[: budget - used]
                out.append(ids)
                used += len(ids)


def place(units: list[list[int]], tail: list[int], needles: list[list[int]], depths: list[float]
          ) -> tuple[list[int], list[float]]:
    """The context ids with needle i inserted at the unit boundary nearest depths[i] (a fraction of the filler,
    0 = first, 1 = last, before the cut tail); returns (ids, each needle's depth as a fraction of the context)."""
    sizes = list(itertools.accumulate((len(u) for u in units), initial=0))  # tokens before boundary j
    total = sizes[-1]
    at: dict[int, list[int]] = {}
    for i, d in enumerate(depths):
        j = bisect.bisect_left(sizes, d * total)  # the first boundary at or after the depth ...
        if j > 0 and (j == len(sizes) or d * total - sizes[j - 1] <= sizes[j] - d * total):
            j -= 1  # ... or the one before it, when that is nearer
        at.setdefault(j, []).append(i)
    ids: list[int] = []
    where = [0] * len(needles)
    for j in range(len(units) + 1):
        for i in at.get(j, []):
            where[i] = len(ids)
            ids += needles[i]
        if j < len(units):
            ids += units[j]
    ids += tail
    return ids, [w / max(len(ids), 1) for w in where]

