"""Preference data (`task: preference`): prompt / chosen / rejected pairs in, shared-prefix token rows out.

    longdoc data prepare pairs.jsonl --task preference --target-tokens 32768 --out pairs.parquet
    longdoc data pairs legal.jsonl --out pairs.jsonl          # pairs from `data synth` QA records (corpus.pairs)

    from longdoc.corpus.preference import pair_of, tokenize_pair, shared_prefix_row
    ids = tokenize_pair(tokenizer, pair_of({"prompt": doc + "\\n\\nQ?", "chosen": "A", "rejected": "B"}))
    row = shared_prefix_row([ids])

Input rows, TRL's two preference formats (the long document is in the prompt):
    text:           {"prompt": str, "chosen": str, "rejected": str}
    conversational: {"prompt": [{role, content}, ...], "chosen": [{"role": "assistant", "content": str}],
                     "rejected": [{"role": "assistant", "content": str}]}
A bad row (a missing field, a wrong type, chosen equal to rejected, a prompt longer than the target) is an
error naming it, or with `--skip-bad` a counted skip (longdoc.corpus.ingest.Skips); never dropped silently.

Tokens follow TRL 1.16.0's DPOTrainer (`_prepare_dataset`'s tokenize_fn, trl/trainer/dpo_trainer.py): text rows
get the EOS appended to chosen and rejected (unless they end with it) and prompt, prompt+chosen, prompt+rejected
are tokenized as the tokenizer does by default; conversational rows render the prompt with the generation prompt
and prompt+chosen, prompt+rejected as whole conversations by the chat template. The prompt is the longest common
prefix of the three token lists (`common_prefix_length`), chosen and rejected what follows it: an answer's
tokens run to the end of the rendered conversation, its end-of-turn token (and any newline the template puts
after it, as TRL does) included. Like TRL, the long prompt is tokenized three times (alone and with each answer).

The shared-prefix row - one sequence [prompt | chosen | rejected] per pair, several pairs packed in a row:
    input_ids     prompt ids + chosen ids + rejected ids (per pair, pairs one after another)
    position_ids  0..P-1 on the prompt, P..P+C-1 on chosen, P..P+R-1 on rejected: rejected continues from the
                  END OF THE PROMPT, not from chosen; every pair restarts at 0 at its prompt
    labels        NOT shifted (as every longdoc row): -100 on the prompt, the token itself on chosen and rejected
    branches      one [prompt_start, chosen_start, rejected_start, end] per pair (token indices in the row)
plus doc_ids and sources (one per pair), and from `data prepare` num_tokens and num_loss_tokens.

Attention (`sibling_mask`, longdoc.corpus.preference_logps): a prompt token sees its pair's prompt causally; a
chosen token the prompt and chosen causally; a rejected token the prompt and rejected causally, never chosen;
no token sees another pair.

Targets - the crux: labels are unshifted, but the usual shift (logit t-1 predicts label t) is WRONG at one place
per pair: rejected's first token is predicted by the prompt's last token, not by chosen's last. So the prompt's
last position predicts two tokens (chosen's first and rejected's first), and no single shifted label vector can
hold both. A loss must pair logits and labels by `branch_targets(row)`: for every labelled token t, the position
whose logit predicts it (t - 1, except rejected_start -> chosen_start - 1), the pair and the side; or, laid out
per position as a CP loss shards its targets, by `shifted_targets(row)`: the usual shifted targets with chosen's
last position predicting nothing, plus one extra [prompt's last position, rejected's first token] per pair.
`pair_logps` is the pure-torch reference: per pair, the summed log-probabilities of chosen and of rejected, equal to
those of the two-sequence form (`two_sequence_rows`: prompt+chosen and prompt+rejected as separate rows, TRL's
layout).
"""

from __future__ import annotations

import json
from typing import Any

from longdoc.corpus.chat import ROLES, ChatError, _content
from longdoc.corpus.windows import IGNORE

FIELDS = ("prompt", "chosen", "rejected")


class PairError(ChatError):
    """A malformed preference row; the reader (longdoc.corpus.ingest) adds where it is."""


# ------------------------------------------------------------------------------------------ parsing
def pair_of(raw: dict) -> dict[str, Any]:
    """The validated {prompt, chosen, rejected} of a record, text (strings) or conversational (message lists)."""
    missing = [k for k in FIELDS if raw.get(k) is None]
    if missing:
        raise PairError(f"record has no field {missing[0]!r} (fields: {sorted(raw)[:12]})",
                        "A preference row needs prompt, chosen and rejected (TRL's explicit-prompt format)",
                        reason="missing field")
    if all(isinstance(raw[k], str) for k in FIELDS):
        pair = {k: raw[k] for k in FIELDS}
        answers = (pair["chosen"], pair["rejected"])
    elif all(isinstance(raw[k], list) for k in FIELDS):
        pair = {"prompt": _messages(raw["prompt"], "prompt"), "chosen": _answer(raw["chosen"], "chosen"),
                "rejected": _answer(raw["rejected"], "rejected")}
        if pair["prompt"][-1]["role"] not in ("user", "tool"):
            raise PairError(f"the prompt's last message is a {pair['prompt'][-1]['role']!r} turn; it must be a user "
                            "(or tool) turn, which the answer follows", reason="bad conversation")
        answers = (pair["chosen"][0]["content"], pair["rejected"][0]["content"])
    else:
        kinds = {k: type(raw[k]).__name__ for k in FIELDS}
        raise PairError(f"prompt, chosen and rejected must be all strings (text format) or all message lists "
                        f"(conversational), got {kinds}", reason="wrong field type")
    if not str(pair["prompt"] if isinstance(pair["prompt"], str) else pair["prompt"][-1]["content"]).strip():
        raise PairError("the prompt is empty", "Remove the record or use --skip-bad", reason="empty field")
    for name, text in zip(FIELDS[1:], answers):
        if not text.strip():
            raise PairError(f"{name} is empty", "Remove the record or use --skip-bad", reason="empty field")
    if " ".join(answers[0].split()) == " ".join(answers[1].split()):
        raise PairError(f"chosen equals rejected ({_shown(answers[0])!r}): the pair teaches nothing",
                        "Remove the record or use --skip-bad", reason="chosen equals rejected")
    return pair


def _messages(items: Any, name: str) -> list[dict[str, str]]:
    if not items:
        raise PairError(f"{name} is an empty list of messages", reason="wrong field type")
    out = []
    for i, m in enumerate(items):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise PairError(f"{name}[{i}] must be a message {{role, content}} with role one of {list(ROLES)}, got "
                            f"{m!r}"[:200], reason="bad conversation")
        try:
            out.append({"role": m["role"], "content": _content(m.get("content"), f"{name}[{i}].content")})
        except ChatError as e:
            raise PairError(e.problem, e.fix, e.reason) from None
    return out


def _answer(items: Any, name: str) -> list[dict[str, str]]:
    messages = _messages(items, name)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise PairError(f"{name} must be a list of one assistant message, got roles {[m['role'] for m in messages]}",
                        reason="bad conversation")
    return messages


def is_conversational(pair: dict[str, Any]) -> bool:
    return isinstance(pair["prompt"], list)


def _shown(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def to_column(record: dict[str, Any]) -> dict[str, Any]:
    """A read record as a `datasets` row of one type whatever its format: the pair as a JSON string."""
    return {"doc_id": record["doc_id"], "source": record["source"],
            "pair": json.dumps({k: record[k] for k in FIELDS}, ensure_ascii=False)}


# --------------------------------------------------------------------------------------- tokenizing
def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """Leading tokens `ids` and `other` share (as trl.data_utils.common_prefix_length, TRL 1.16.0)."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


def tokenize_pair(tokenizer: Any, pair: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) as TRL 1.16.0's DPOTrainer tokenizes a pair (see the module doc)."""
    if is_conversational(pair):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("conversational preference rows need a tokenizer with a chat template (this one has "
                             "none); use a chat model's tokenizer, or give text rows")

        def ids(messages: list[dict[str, str]], prompt: bool = False) -> list[int]:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=prompt)
            return list(out["input_ids"])

        prompt = ids(pair["prompt"], prompt=True)
        with_chosen, with_rejected = ids(pair["prompt"] + pair["chosen"]), ids(pair["prompt"] + pair["rejected"])
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (t if t.endswith(eos) else t + eos for t in (pair["chosen"], pair["rejected"]))

        def ids(text: str) -> list[int]:  # type: ignore[misc]
            return list(tokenizer(text, verbose=False)["input_ids"])

        prompt = ids(pair["prompt"])
        with_chosen, with_rejected = ids(pair["prompt"] + chosen), ids(pair["prompt"] + rejected)
    # where the answers start: where prompt and prompt+answer diverge (a template may render the prompt alone
    # differently, or tokens may merge across the boundary); TRL drops the prompt's tail beyond it too
    n = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
    return prompt[:n], with_chosen[n:], with_rejected[n:]


# ------------------------------------------------------------------------------------------- rows
def shared_prefix_row(pairs: list[tuple[list[int], list[int], list[int]]], doc_ids: list[str] | None = None,
                      sources: list[str] | None = None) -> dict[str, Any]:
    """One row holding every (prompt, chosen, rejected) id triple of `pairs` (the schema of the module doc)."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    branches: list[list[int]] = []
    for prompt, chosen, rejected in pairs:
        if not prompt or not chosen or not rejected:
            raise ValueError(f"a pair needs a prompt, a chosen and a rejected token, got lengths "
                             f"{len(prompt)}, {len(chosen)}, {len(rejected)}")
        p, c, r = len(prompt), len(chosen), len(rejected)
        start = len(ids)
        branches.append([start, start + p, start + p + c, start + p + c + r])
        ids += prompt + chosen + rejected
        pos += list(range(p + c)) + list(range(p, p + r))
        labels += [IGNORE] * p + chosen + rejected
    n = len(pairs)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "branches": branches,
            "doc_ids": list(doc_ids or [""] * n), "sources": list(sources or [""] * n)}


def preference_rows(tokenizer: Any, pairs: list[str], doc_ids: list[str], sources: list[str], target: int,
                    pack: bool = False) -> list[dict[str, Any]]:
    """Rows of JSON-encoded pairs (`to_column`) for `longdoc.corpus.prepare`: one pair per row, or with `pack`
    consecutive pairs sharing rows of at most `target` tokens. A pair that does not fit gives an empty row whose
    `error` and `error_reason` say why (a prompt alone over the target, or the whole pair)."""
    rows: list[dict[str, Any]] = []
    cur: list[tuple[tuple[list[int], list[int], list[int]], str, str]] = []

    def flush() -> None:
        if cur:
            rows.append({**shared_prefix_row([t for t, _, _ in cur], [d for _, d, _ in cur], [s for _, _, s in cur]),
                         "error": "", "error_reason": ""})
            cur.clear()

    for text, doc_id, source in zip(pairs, doc_ids, sources):
        triple = tokenize_pair(tokenizer, json.loads(text))
        p, n = len(triple[0]), sum(map(len, triple))
        if n > target:
            why, reason = ((f"the prompt has {p} tokens, more than the target of {target}", "prompt too long")
                           if p >= target else (f"prompt + chosen + rejected take {n} tokens ({p} of prompt), more "
                                                f"than the target of {target}", "pair too long"))
            rows.append({**shared_prefix_row([], [doc_id], [source]), "error": f"{source}: {why}; raise "
                         f"--target-tokens or shorten the document", "error_reason": reason})
            continue
        if not pack or (cur and sum(len(x) for t, _, _ in cur for x in t) + n > target):
            flush()
        cur.append((triple, doc_id, source))
        if not pack:
            flush()
    flush()
    return rows
