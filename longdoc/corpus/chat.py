"""Chat and instruction data (`task: chat`): conversations in, token rows with the loss on assistant turns out.

    longdoc data prepare chats.jsonl --task chat --target-tokens 32768 --out chats.parquet
    longdoc data prepare chats.jsonl --task chat --loss-on all --truncation right --pack --out chats.parquet

    from longdoc.corpus.chat import chat_row
    row = chat_row(tokenizer, [{"role": "user", "content": doc + "\\n\\nSummarise."},
                               {"role": "assistant", "content": "..."}], target=32768)

Input: one conversation per record, `messages` [{role, content}] (OpenAI style; a content list of
{type: text, text} parts is joined) or ShareGPT's `conversations` [{from, value}] (human -> user,
gpt -> assistant, system -> system). Roles: system, user, assistant, tool; at least one assistant turn after
the first message (an opening assistant greeting is context: no generation prompt precedes it).

Rendering: the tokenizer's own chat template renders the whole conversation once, and the conversation up
to each turn (with the generation prompt before each assistant turn) must render to a prefix of that text:
a template that rewrites earlier turns is refused by name. An assistant turn's trained span runs from the
end of its generation prompt to the end of its turn, trailing whitespace left out: the end-of-turn token is
trained (the model learns to stop), the newline that opens the next turn is not - what a template with
`{% generation %}...{% endgeneration %}` around the content and end-of-turn token marks (TRL's
assistant_only_loss). The text is tokenized once; tokens join a span by their character offsets, so a long
document in any turn is tokenized once, not once per prefix.

Loss (`loss_on`): "assistant" (default) labels every assistant turn's span and nothing else (-100);
"all" labels every token.

Truncation, for a conversation longer than `target`: the chat template's tokens and the trained assistant
turns (every assistant turn, or with loss_on="all" the last one) are never cut. The other turns' content is
cut, longest turn first (the long document), from its start (`truncation="left"`, default: the part nearest
the answer stays) or its end ("right"). A conversation whose protected tokens alone exceed `target` gives no
row: its error names the source and the sizes (an error, or a counted skip with --skip-bad).

Packing (`pack=True`): consecutive short conversations share a row, each one a document of its own
(position_ids restart at 0, cu_seqlens; `longdoc train` and CPTrainer mask them apart), as pretrain packing.

Row columns beside the usual ones (longdoc.corpus.prepare): `chat_parts` per conversation
[system, user, assistant, template, cut] token counts (tool turns count as user; template: role headers,
end-of-turn tokens, a default system prompt the template adds), and their row sums `system_tokens`,
`user_tokens`, `assistant_tokens`, `template_tokens`, `cut_tokens`, which `data prepare` reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from longdoc.corpus.windows import IGNORE, pack_rows, segment_row

ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("assistant", "all")
TRUNCATION = ("left", "right")
PARTS = ("system", "user", "assistant", "template", "cut")
_SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
             "tool": "tool"}
_TEMPLATE = -1  # owner of a token that belongs to no message's content


class ChatError(ValueError):
    """A malformed conversation; the reader (longdoc.corpus.ingest) adds where it is."""

    def __init__(self, problem: str, fix: str = "", reason: str = ""):
        super().__init__(problem)
        self.problem, self.fix, self.reason = problem, fix, reason or "bad conversation"


# ------------------------------------------------------------------------------------------ parsing
def messages_of(raw: dict) -> list[dict[str, str]]:
    """The conversation of a record as [{role, content}], from `messages` or ShareGPT `conversations`."""
    if raw.get("messages") is not None:
        name, role_key, text_key, roles = "messages", "role", "content", {r: r for r in ROLES}
    elif raw.get("conversations") is not None:
        name, role_key, text_key, roles = "conversations", "from", "value", _SHAREGPT
    else:
        raise ChatError(f"record has neither 'messages' nor 'conversations' (fields: {sorted(raw)[:12]})",
                        "Give each record a messages list [{role, content}, ...] (or ShareGPT conversations "
                        "[{from, value}, ...])", reason="missing field")
    items = raw[name]
    if not isinstance(items, list) or not items:
        raise ChatError(f"field {name!r} must be a non-empty list of turns, got {type(items).__name__}"
                        + (" (empty)" if isinstance(items, list) else ""), reason="wrong field type")
    out = []
    for i, m in enumerate(items):
        at = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{at} must be an object {{{role_key}, {text_key}}}, got {type(m).__name__}",
                            reason="not an object")
        role = m.get(role_key)
        if role not in roles:
            raise ChatError(f"{at}: {role_key} {role!r} is not one of {sorted(roles)}", reason="unknown role")
        content = _content(m.get(text_key), f"{at}.{text_key}")
        if roles[role] == "assistant" and not content.strip():
            raise ChatError(f"{at}: the assistant turn is empty", "Remove the turn or the record (--skip-bad)",
                            reason="empty assistant turn")
        out.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in out[1:]):  # an opening assistant turn is context, not trained
        raise ChatError(f"{name} has no assistant turn after its first message (roles: {[m['role'] for m in out]})",
                        "A conversation trains on its assistant turns; give it at least one",
                        reason="no assistant turn")
    return out


def _content(value: Any, at: str) -> str:
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        value = "".join(str(p.get("text", "")) for p in value)  # OpenAI content parts, text only
    if not isinstance(value, str):
        raise ChatError(f"{at} must be a string (or a list of text parts), got {type(value).__name__}",
                        reason="wrong field type")
    return value


def qa_conversation(record: dict) -> dict[str, Any]:
    """A generated document with its questions (longdoc.corpus.synth) as one conversation: the document and the
    first question in the first user turn, every answer an assistant turn (`longdoc data synth --chat`)."""
    messages: list[dict[str, str]] = []
    for i, qa in enumerate(record["qa"]):
        user = f"Read this document and answer my questions briefly.\n\n{record['document']}\n\n" if not i else ""
        messages += [{"role": "user", "content": user + qa["question"]}, {"role": "assistant", "content": qa["answer"]}]
    return {"id": record["id"], "domain": record.get("domain"), "messages": messages}


# ---------------------------------------------------------------------------------------- rendering
@dataclass
class Rendered:
    """One conversation as tokens: ids, labels, and per token the message whose content it is (-1: template)."""

    ids: list[int]
    labels: list[int]
    owner: list[int]
    roles: list[str]  # of the messages
    trained: set[int]  # messages whose tokens are labelled (and so never cut)

    def parts(self, cut: int = 0) -> list[int]:
        """[system, user, assistant, template, cut] token counts."""
        counts = dict.fromkeys(PARTS, 0)
        for m in self.owner:
            role = "template" if m == _TEMPLATE else self.roles[m]
            counts["user" if role == "tool" else role] += 1
        counts["cut"] = cut
        return list(counts.values())


def render(tokenizer: Any, messages: list[dict[str, str]], loss_on: str = "assistant") -> Rendered:
    """Tokens and labels of a conversation rendered by the tokenizer's chat template (see the module doc)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("task 'chat' needs a tokenizer with a chat template (this one has none); use a chat "
                         "model's tokenizer, or set tokenizer.chat_template")

    def text(upto: int, prompt: bool = False) -> str:
        if upto == 0 and not prompt:
            return ""
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    full = text(len(messages))
    content: list[tuple[int, int]] = []  # character span of each message's content in `full`
    answers: list[tuple[int, int, int]] = []  # (message, start, end) character spans of assistant turns
    before = ""
    for i, m in enumerate(messages):
        upto = text(i + 1)
        # an opening assistant turn (a greeting) has no generation prompt before it: context, not trained
        answer = m["role"] == "assistant" and i > 0
        opening = text(i, prompt=True) if answer else before
        if not (full.startswith(upto) and upto.startswith(before) and upto.startswith(opening)):
            raise ValueError("the chat template rewrites earlier turns of a conversation (rendering the first "
                             f"{i + 1} messages is not a prefix of the whole); task 'chat' needs a template that "
                             "only appends turns")
        turn = upto[len(before):]
        # the last occurrence: a role header precedes the content (content "user" must not match the header)
        at = turn.rfind(m["content"]) if m["content"] else -1
        if at < 0 and m["content"].strip():
            at = turn.rfind(m["content"].strip())
            span = (len(before) + at, len(before) + at + len(m["content"].strip())) if at >= 0 else None
        else:
            span = (len(before) + at, len(before) + at + len(m["content"])) if at >= 0 else None
        if span is None and m["content"].strip():
            raise ValueError(f"the chat template does not show message {i} ({m['role']}) verbatim; task 'chat' "
                             "cannot tell its content from the template's tokens")
        content.append(span or (len(before), len(before)))
        if answer:
            answers.append((i, len(opening), len(upto.rstrip())))
        before = upto
    if not answers:
        raise ValueError("the conversation has no assistant turn after its first message (an opening assistant "
                         "turn is context, not trained); nothing to train")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    owner = [_TEMPLATE] * len(ids)
    in_answer = [False] * len(ids)
    # one pass over tokens and (sorted, disjoint) spans: a token belongs to the span holding its first character
    for spans, mark in ((sorted((a, b, i) for i, (a, b) in enumerate(content)), "owner"),
                        (sorted((a, b, i) for i, a, b in answers), "answer")):
        k = 0
        for t, (start, _) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= start:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                if mark == "owner":
                    owner[t] = spans[k][2]
                else:
                    in_answer[t] = True
    if loss_on == "all":
        labels = list(ids)
        trained = {max(i for i, _, _ in answers)}
    else:
        labels = [x if a else IGNORE for x, a in zip(ids, in_answer)]
        trained = {i for i, _, _ in answers}
    return Rendered(ids, labels, owner, [m["role"] for m in messages], trained)


# --------------------------------------------------------------------------------------- truncation
def truncate(r: Rendered, target: int, side: str = "left") -> int:
    """Cut `r` in place to at most `target` tokens (see the module doc); returns the tokens cut. Raises
    ValueError when the template and the trained turns alone are longer than `target`."""
    if side not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {side!r}")
    excess = len(r.ids) - target
    if excess <= 0:
        return 0
    sizes: dict[int, int] = {}
    for m in r.owner:
        if m != _TEMPLATE and m not in r.trained:
            sizes[m] = sizes.get(m, 0) + 1
    if sum(sizes.values()) < excess:
        kept = len(r.ids) - sum(sizes.values())
        raise ValueError(f"the trained assistant turn(s) and the chat template alone take {kept} tokens, more than "
                         f"the target of {target} (the conversation has {len(r.ids)}); raise --target-tokens or "
                         "split the conversation")
    drop: dict[int, int] = {}
    for m in sorted(sizes, key=lambda m: (-sizes[m], m)):  # longest first: the long document
        drop[m] = min(excess - sum(drop.values()), sizes[m])
        if sum(drop.values()) == excess:
            break
    seen: dict[int, int] = {}
    keep = []
    for t, m in enumerate(r.owner):
        n = seen[m] = seen.get(m, 0) + 1
        if m in drop and (n <= drop[m] if side == "left" else n > sizes[m] - drop[m]):
            continue
        keep.append(t)
    r.ids, r.labels, r.owner = [r.ids[t] for t in keep], [r.labels[t] for t in keep], [r.owner[t] for t in keep]
    return excess


def chat_row(tokenizer: Any, messages: list[dict[str, str]], target: int, loss_on: str = "assistant",
             truncation: str = "left", doc_id: str = "", source: str = "") -> dict[str, Any]:
    """One training row (the longdoc.corpus.prepare columns plus `chat_parts`); a conversation that cannot
    fit gives an empty row whose `error` says why."""
    r = render(tokenizer, messages, loss_on)
    try:
        cut = truncate(r, target, truncation)
    except ValueError as e:
        return {**segment_row([], [], doc_id, source, 0), "chat_parts": [r.parts()], "error": f"{source}: {e}"}
    return {**segment_row(r.ids, r.labels, doc_id, source, 0), "chat_parts": [r.parts(cut)], "error": ""}


def chat_rows(tokenizer: Any, conversations: list[list[dict[str, str]]], doc_ids: list[str], sources: list[str],
              target: int, loss_on: str = "assistant", truncation: str = "left", pack: bool = False
              ) -> list[dict[str, Any]]:
    """Rows of several conversations (in order), packed into rows of at most `target` tokens with `pack`;
    each row gets the part sums (`system_tokens`, ...)."""
    rows = [chat_row(tokenizer, msgs, target, loss_on, truncation, d, s)
            for msgs, d, s in zip(conversations, doc_ids, sources)]
    if pack:
        good = pack_rows([r for r in rows if not r["error"]], target, extend=("chat_parts",))
        rows = [r for r in rows if r["error"]] + [{**r, "error": ""} for r in good]
    for row in rows:
        for k, name in enumerate(PARTS):
            row[f"{name}_tokens"] = sum(p[k] for p in row["chat_parts"])
    return rows


def parts_summary(rows: dict[str, list]) -> str:
    """One line of the row-length report: tokens per part over all rows (columns of `chat_rows`)."""
    totals = {name: sum(rows[f"{name}_tokens"]) for name in PARTS}
    n = sum(v for k, v in totals.items() if k != "cut") or 1
    shown = ", ".join(f"{name} {totals[name]} ({100 * totals[name] / n:.0f}%)" for name in PARTS[:4])
    conversations = sum(len(p) for p in rows["chat_parts"])
    cut = sum(1 for parts in rows["chat_parts"] for p in parts if p[4])
    return (f"chat: {conversations} conversations; tokens by part: {shown}; truncation cut {totals['cut']} tokens "
            f"from {cut} conversation(s)")


def collate(features: list[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """A Trainer/CPTrainer data collator for prepared rows (chat or pretrain): right-padded input_ids and
    unshifted labels (-100 on padding); packed rows (position_ids restarting at 0) also carry position_ids,
    the padding being one more document, as `longdoc train` collates them."""
    import torch

    n = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), n), pad_id, dtype=torch.long)
    labels = torch.full((len(features), n), IGNORE, dtype=torch.long)
    pos = torch.arange(n).repeat(len(features), 1)
    packed = False
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        ids[i, :k], labels[i, :k] = torch.as_tensor(f["input_ids"]), torch.as_tensor(f["labels"])
        if f.get("position_ids") is not None:
            p = torch.as_tensor(f["position_ids"])
            packed = packed or bool((p[1:] == 0).any())
            pos[i, :k], pos[i, k:] = p, torch.arange(n - k)
    return {"input_ids": ids, "labels": labels, **({"position_ids": pos} if packed else {})}
