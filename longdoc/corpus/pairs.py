"""`longdoc data pairs`: preference pairs from QA records - the gold answer chosen, a wrong answer from the same
document rejected (`longdoc data prepare --task preference` tokenizes them; longdoc.corpus.preference).

    longdoc data synth --domain legal --num-docs 8 --tokens 8192 --out legal.jsonl
    longdoc data pairs legal.jsonl --out legal-pairs.jsonl                 # text format
    longdoc data pairs legal.jsonl --chat --out legal-pairs.jsonl          # conversational format
    longdoc data pairs legal.jsonl --model SmolLM2-135M-Instruct --out on-policy.jsonl

Input: QA records as `data prepare --task qa` and `eval qa` read them (longdoc.corpus.ingest; `data synth` writes
them). Per question, the rejected answer is, in this order:
    same family    the answer of the nearest other question of the same family (the template's name: a second
                   invoice's total, another witness's deposition date, another drug's latest dose)
    document value for a numeric answer, another value written in the same context as the gold one: the gold
                   evidence with the answer's digits left free, searched in the whole document, the nearest match
                   kept. This is what a distractor question (kind "distractor": one lab of an analyte among many,
                   one invoice among several) asks the model to tell apart; the records do not list the other
                   values, so they are read back from the document.
    same kind      the answer of the nearest other question of the same kind
A question with none of them gives no pair and is counted ("no distractor in the document"); a value equal to the
gold answer or one of its aliases (up to case, spacing and punctuation) is never taken.

With `model` the rejected answer is instead that model's own answer (on-policy): greedy, or sampled once with
`temperature` and `seed`, over one prefill of the document per record (longdoc.hf.session.KVSession), prompted
exactly as the pair's own prompt reads (the plain layout, or with `chat` the chat template's; both are
longdoc.corpus.qa_format's, as training and evaluation prompt). An answer equal to the gold one gives no pair
("model answered correctly"), an empty one neither ("model gave no answer"); both are counted.

Output rows: TRL's text format {prompt, chosen, rejected} (prompt: "<document>\\n\\nQuestion: ...\\nAnswer:",
answers with a leading space, as qa_format's plain layout) or with `chat` the conversational one (one user turn:
the instruction, the document and the question, as qa_format's chat layout), plus id, doc_id, qa_id, kind and
`rejected_from` (the reason above, or "model").
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from longdoc.corpus.qa_format import INSTRUCTION

NUMBER = r"\d(?:[\d,.]*\d)?"
_CONTEXT = (40, 16)  # characters kept on each side of a written answer when searching for its siblings
_PUNCT = str.maketrans("", "", string.punctuation)


def same_answer(a: str, b: str) -> bool:
    """Equal up to case, spacing and punctuation ("$1,200" and "1200" are the same answer)."""
    return "".join(a.translate(_PUNCT).casefold().split()) == "".join(b.translate(_PUNCT).casefold().split())


def _golds(qa: dict[str, Any]) -> list[str]:
    return [str(qa["answer"]), *(str(a) for a in qa.get("aliases") or [])]


def _is_gold(value: str, qa: dict[str, Any]) -> bool:
    return any(same_answer(value, g) for g in _golds(qa))


def _nearest(qas: list[dict[str, Any]], i: int, key: str) -> str | None:
    """The answer of the question nearest to question i (the later one on a tie) sharing its `key`, not gold."""
    want = qas[i][key]
    order = sorted((j for j in range(len(qas)) if j != i), key=lambda j: (abs(j - i), -j))
    for j in order:
        if qas[j][key] == want and not _is_gold(str(qas[j]["answer"]), qas[i]):
            return str(qas[j]["answer"])
    return None


def _pattern(text: str) -> str:
    """A regex for `text` with every number free and any whitespace run matching any other."""
    out = []
    for piece in re.split(rf"({NUMBER}|\s+)", text):
        if piece:
            out.append(f"(?:{NUMBER})" if re.fullmatch(NUMBER, piece) else r"\s+" if piece.isspace()
                       else re.escape(piece))
    return "".join(out)


def _written_at(evidence: str, gold: str) -> int:
    """Where `gold` is written in `evidence` as a whole (not inside a longer number or word), else -1."""
    m = re.search(rf"(?<![\w.,]){re.escape(gold)}(?![\w]|[.,]\d)", evidence, re.IGNORECASE)
    return m.start() if m else -1


def document_value(document: str, qa: dict[str, Any]) -> str | None:
    """Another value written where a numeric gold answer is written (see the module doc), nearest to it. Answers
    computed rather than written (counts, intervals: `extractive` false) have none."""
    if qa.get("extractive") is False:
        return None
    for start, end in qa.get("spans") or []:
        for gold in _golds(qa):
            at = start + _written_at(document[start:end], gold) if re.search(r"\d", gold) else -1
            if at < start:
                continue
            for width in _CONTEXT:  # the answer's own line around it: a long context first, then a short one
                left = document[max(0, at - width):at].split("\n")[-1]
                right = document[at + len(gold):at + len(gold) + width].split("\n")[0]
                if not (left.strip() or right.strip()):
                    continue
                value = rf"(?<![\w.,])(?P<value>{_pattern(gold)})(?![\w]|[.,]\d)"
                regex = re.compile(f"{_pattern(left)}{value}{_pattern(right)}", re.IGNORECASE)
                found = [(abs(m.start("value") - at), m.group("value")) for m in regex.finditer(document)]
                values = sorted((d, v) for d, v in found if not _is_gold(v, qa))
                if values:
                    return values[0][1]
    return None


def distractor(document: str, qas: list[dict[str, Any]], i: int) -> tuple[str | None, str]:
    """(rejected answer, where it came from) for question i of a record, or (None, why not)."""
    value = document_value(document, qas[i])
    if value is not None:
        return value, "document value"
    keyed = [{**q, "family": str(q.get("template") or "").split("/")[0] or None,
              "kind+shape": (q.get("kind") or None, _shape(str(q["answer"])))} for q in qas]
    # the same family first; within a kind, an answer of the same shape (a date for a date) before any other
    for key, origin in (("family", "same family"), ("kind+shape", "same kind"), ("kind", "same kind")):
        if keyed[i][key] not in (None, (None, _shape(str(qas[i]["answer"])))):
            value = _nearest(keyed, i, key)
            if value is not None:
                return value, origin
    return None, "no distractor in the document"


def _shape(answer: str) -> str:
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}", answer.strip()):
        return "date"
    return "money" if answer.strip().startswith("$") else "number" if re.search(r"\d", answer) else "text"


def pair_row(record: dict[str, Any], qa: dict[str, Any], rejected: str, chat: bool, origin: str) -> dict[str, Any]:
    """One preference row for question `qa` of `record` (read by longdoc.corpus.ingest), text or conversational."""
    meta = {"id": f"{qa['qa_id']}", "doc_id": record["doc_id"], "qa_id": qa["qa_id"], "kind": qa.get("kind", ""),
            "rejected_from": origin}
    question, gold = qa["question"].strip(), str(qa["answer"]).strip()
    if chat:
        user = f"{INSTRUCTION}\n\n{record['document']}\n\nQuestion: {question}"
        return {"prompt": [{"role": "user", "content": user}], "chosen": [{"role": "assistant", "content": gold}],
                "rejected": [{"role": "assistant", "content": rejected.strip()}], **meta}
    return {"prompt": f"{record['document']}\n\nQuestion: {question}\nAnswer:", "chosen": f" {gold}",
            "rejected": f" {rejected.strip()}", **meta}


def build(records: list[dict[str, Any]], chat: bool = False, answers: list[list[str]] | None = None
          ) -> tuple[list[dict[str, Any]], Counter, Counter]:
    """(pair rows, made by origin, skipped by reason) from QA records; `answers` (one list per record, one answer
    per question): a model's own answers, used as the rejected ones instead of distractors."""
    rows: list[dict[str, Any]] = []
    made: Counter = Counter()
    skipped: Counter = Counter()
    for k, rec in enumerate(records):
        for i, qa in enumerate(rec["qas"]):
            if answers is None:
                value, origin = distractor(rec["document"], rec["qas"], i)
            else:
                value, origin = answers[k][i].strip(), "model"
                if not value:
                    value, origin = None, "model gave no answer"
                elif _is_gold(value, qa):
                    value, origin = None, "model answered correctly"
            if value is None:
                skipped[origin] += 1
                continue
            rows.append(pair_row(rec, qa, value, chat, origin))
            made[origin] += 1
    return rows, made, skipped


def counts_line(made: Counter, skipped: Counter) -> str:
    """`made N pairs (a same family, b document value, ...); skipped M questions (...)`."""
    def some(c: Counter) -> str:
        return ", ".join(f"{n} {why}" for why, n in sorted(c.items())) or "none"

    return (f"made {sum(made.values())} pairs ({some(made)}); skipped {sum(skipped.values())} questions "
            f"({some(skipped)})")


# ----------------------------------------------------------------------------------------- on-policy
KEEP = ("aliases", "template", "extractive")  # the QA record fields the distractors use, kept by the reader
_STOP_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")


def stop_ids(tokenizer: Any) -> list[int]:
    """Ids that end an answer: EOS and the chat template's end-of-turn token (as longdoc.eval.prompts.Prompter,
    which this layer may not import)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for name in _STOP_NAMES:
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return sorted(ids)


def decode_answer(tokenizer: Any, ids: list[int], stops: list[int]) -> str:
    """A generated answer as text, as evaluation reads it: up to the first stop token, its first non-empty line."""
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    lines = [line.strip() for line in tokenizer.decode(ids[:cut], skip_special_tokens=True).splitlines()]
    return next((line for line in lines if line), "")


def model_answers(model: Any, tokenizer: Any, records: list[dict[str, Any]], *, max_new_tokens: int = 32,
                  temperature: float = 0.0, seed: int = 0, chat: bool | None = None) -> list[list[str]]:
    """The model's answer to every question of every record (one list per record): greedy (`temperature` 0) or
    sampled once per question from a generator seeded by (seed, record, question); one prefill per document."""
    import torch

    from longdoc.corpus.qa_format import qa_parts
    from longdoc.hf.decode import Sampler
    from longdoc.hf.session import KVSession
    from longdoc.parallel.api import ContextParallel

    chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    head = qa_parts(tokenizer, "", use_chat_template=chat).prefix
    stops = stop_ids(tokenizer)
    sampler = Sampler(do_sample=True, temperature=temperature) if temperature > 0 else None
    device = next(model.parameters()).device
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    out = []
    for k, rec in enumerate(records):
        prefix = head + list(tokenizer(rec["document"], add_special_tokens=False, verbose=False)["input_ids"])
        suffixes = [qa_parts(tokenizer, qa["question"].strip(), use_chat_template=chat).suffix for qa in rec["qas"]]
        longest = len(prefix) + max(map(len, suffixes)) + max_new_tokens
        if limit is not None and longest > limit:
            raise ValueError(f"{rec['source']}: the prompt and answer take up to {longest} tokens, more than the "
                             f"model's context of {limit}; use shorter documents or a model with a longer context")
        answers = []
        with torch.no_grad(), KVSession(model, ContextParallel()) as session:
            session.prefill(torch.tensor([prefix], device=device))
            start = session.mark()
            for i, suffix in enumerate(suffixes):
                logits = session.extend(torch.tensor([suffix], device=device))[:, -1]
                gen = session.decode(logits, max_new_tokens, stops, sampler=sampler,
                                     seed=None if sampler is None else seed * 1_000_003 + k * 1_009 + i)
                session.rollback(start)
                answers.append(decode_answer(tokenizer, gen.tokens[0].tolist(), stops))
        out.append(answers)
    return out
