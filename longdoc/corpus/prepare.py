"""`longdoc data prepare`: documents in, tokenized training rows out (a `datasets.Dataset`).

    longdoc data prepare cases.jsonl --task qa --target-tokens 32768 --out data/cases-qa
    longdoc data prepare notes/ --task pretrain --target-tokens 65536 --overlap 4096 --out notes.parquet

    from longdoc.corpus.prepare import prepare
    ds = prepare(["cases.jsonl"], task="qa", target_tokens=32768)          # default tokenizer
    ds = prepare(synthesize("legal", 4, 32768), task="pretrain")             # records work as inputs too

Rows (columns): input_ids, labels (NOT shifted; -100 = no loss), position_ids (restart per document
segment), cu_seqlens (segment boundaries), doc_ids, sources ("file:line"), token_starts (where each
segment starts in its document's tokens), num_tokens, num_loss_tokens; QA rows add qa_id,
kind, doc_pieces (the document token ranges shown) and doc_span ([start, end) of the document in the
row). See data/README.md for the details.

- pretrain: whole documents (+ EOS); longer than the target -> windows of exactly `target_tokens`
  overlapping by `overlap` (default target/8), each token scored once. Packing short documents into
  one row (`pack=True`) is off by default; packed rows record their documents (position_ids restarting
  at 0, cu_seqlens) and `longdoc train` masks them: each document attends only to itself.
- qa: prompt (chat template when the tokenizer has one) + document + several question -> answer
  turns, loss on every answer's tokens only. `questions_per_row` (default None: all that fit) caps the
  questions of a row; a document whose questions do not all fit gives several rows. A document that
  does not fit is cut to a window that keeps every included question's evidence span (pieces joined by
  " [...] " when the spans lie far apart). The question order is shuffled per (seed, epoch, document):
  `epochs=E` writes E passes over every document, each with its own order and windows (the trainer
  asks for as many passes as its steps consume, see `longdoc.train.data.load_sequences`). The first
  turn of a row is exactly the evaluation prompt of its question (`qa_format.qa_turns`).
- chat: conversations (`messages`, or ShareGPT `conversations`) rendered by the tokenizer's chat template,
  loss on the assistant turns (`chat_loss="assistant"`, default) or on every token ("all"); a conversation
  longer than the target loses content of its other turns, longest first, from the `truncation` side, never
  a trained assistant turn; `pack=True` packs short conversations. See longdoc.corpus.chat.
- preference: prompt / chosen / rejected pairs (TRL's text or conversational format), one shared-prefix row
  [prompt | chosen | rejected] per pair (`pack=True`: several pairs a row), with `branches` and positions of
  rejected continuing from the prompt; a pair longer than the target is an error (a counted skip with `skips`).
  See longdoc.corpus.preference for the row schema and how a loss must pair its logits and labels.
Tokenization runs in `datasets.map` with `num_proc` workers; results are cached under `cache_dir`
keyed by the inputs' content, the tokenizer and every option, so a rerun loads from the cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from longdoc.corpus import tokens as tk
from longdoc.corpus.chat import LOSS_ON, TRUNCATION, chat_rows
from longdoc.corpus.ingest import CorpusError, Fields, Skips, read_documents
from longdoc.corpus.preference import preference_rows, to_column
from longdoc.corpus.qa_format import INSTRUCTION, qa_turns
from longdoc.corpus.windows import evidence_pieces, pack_rows, pretrain_rows, qa_turns_row, segment_row

MAX_TARGET = 1 << 20
_CACHE_VERSION = 4
_SEP = " [...] "


def prepare(inputs: str | Path | list, tokenizer: Any = None, *, task: str = "pretrain",
            target_tokens: int = 32768, overlap: int | None = None, pack: bool = False,
            fields: Fields | None = None, skips: Skips | None = None, num_proc: int = 1,
            cache_dir: str | Path | None = None, split: str = "train", seed: int = 0, add_eos: bool = True,
            use_chat_template: bool | None = None, batch_size: int = 64, questions_per_row: int | None = None,
            epochs: int = 1, chat_loss: str = "assistant", truncation: str = "left"):
    """Tokenized rows for `task` ("pretrain" | "qa" | "chat" | "preference"); bad input raises `CorpusError`
    unless `skips` is given, which then counts what was left out (see `Skips.summary`)."""
    import datasets

    if not 64 <= target_tokens <= MAX_TARGET:
        raise ValueError(f"target_tokens must be in [64, {MAX_TARGET}], got {target_tokens}")
    overlap = target_tokens // 8 if overlap is None else overlap
    if not 0 <= overlap < target_tokens:
        raise ValueError(f"overlap must be in [0, target_tokens) = [0, {target_tokens}), got {overlap}")
    if pack and task == "qa":
        raise ValueError("pack=True is for task='pretrain' or 'chat' (a QA row already holds one document's "
                         "questions)")
    if chat_loss not in LOSS_ON or truncation not in TRUNCATION:
        raise ValueError(f"chat_loss must be one of {LOSS_ON} and truncation one of {TRUNCATION}, got "
                         f"{chat_loss!r} and {truncation!r}")
    if questions_per_row is not None and questions_per_row < 1:
        raise ValueError(f"questions_per_row must be >= 1 (or None: all that fit), got {questions_per_row}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    tok = tk.get_tokenizer(tokenizer)
    inputs = inputs if isinstance(inputs, list) else [inputs]
    records = list(read_documents(inputs, task, fields or Fields(), skips, split))
    if not records:
        raise CorpusError(str(inputs)[:200], "no usable documents" + (f" ({skips.summary()})" if skips else ""))
    options = {"task": task, "target": target_tokens, "overlap": overlap, "pack": pack, "add_eos": add_eos,
               "seed": seed, "use_chat_template": use_chat_template, "questions_per_row": questions_per_row,
               "epochs": epochs, "chat_loss": chat_loss, "truncation": truncation}
    cache = Path(cache_dir) if cache_dir else Path(datasets.config.HF_DATASETS_CACHE) / "longdoc"
    cache.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(records, tok, options)[:40]  # datasets appends shard suffixes; <= 64 chars
    # preference pairs are strings or message lists: one JSON column gives every row one type
    ds = datasets.Dataset.from_list([to_column(r) for r in records] if task == "preference" else records)
    ds = ds.map(_rows, batched=True, batch_size=batch_size, num_proc=num_proc if num_proc > 1 else None,
                remove_columns=ds.column_names, fn_kwargs={"tokenizer": tok, **options},
                cache_file_name=str(cache / f"prepare-{fingerprint[:20]}.arrow"), new_fingerprint=fingerprint,
                desc=f"tokenizing ({task})")
    errors = ds["error"]
    default = {"chat": "conversation does not fit", "qa": "evidence does not fit"}.get(task, "does not fit")
    reasons = ds["error_reason"] if "error_reason" in ds.column_names else [""] * len(errors)
    for message, reason in ((e, r) for e, r in zip(errors, reasons) if e):
        err = CorpusError(*message.split(": ", 1), reason=reason or default)
        if skips is None:
            raise err
        skips.add(err)
    if any(errors):
        ds = ds.select([i for i, e in enumerate(errors) if not e])
    if len(ds) == 0:
        raise CorpusError(", ".join(map(str, inputs))[:200], "no rows left: " + (skips.summary() if skips else
                                                                                 "no document gave a row"))
    return ds.remove_columns([c for c in ("error", "error_reason") if c in ds.column_names])


def save(ds: Any, out: str | Path) -> str:
    """Write rows to a `.jsonl` or `.parquet` file, or else a `save_to_disk` folder; returns the kind."""
    out = str(out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # `--out some/new/dir/rows.jsonl` makes the folder
    if out.endswith(".jsonl"):
        ds.to_json(out, lines=True)
        return "jsonl"
    if out.endswith(".parquet"):
        ds.to_parquet(out)
        return "parquet"
    ds.save_to_disk(out)
    return "dataset folder (datasets.load_from_disk)"


def _fingerprint(records: list[dict], tok: Any, options: dict) -> str:
    h = hashlib.sha256(f"longdoc-prepare-{_CACHE_VERSION}{json.dumps(options, sort_keys=True)}{INSTRUCTION}".encode())
    backend = getattr(tok, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))).encode())
    h.update(repr((getattr(tok, "chat_template", None), tok.eos_token, type(tok).__name__)).encode())
    for r in records:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _rows(batch: dict[str, list], tokenizer: Any, task: str, target: int, overlap: int, pack: bool,
          add_eos: bool, seed: int, use_chat_template: bool | None, questions_per_row: int | None,
          epochs: int, chat_loss: str, truncation: str) -> dict[str, list]:
    rows: list[dict[str, Any]] = []
    if task == "preference":
        rows = preference_rows(tokenizer, batch["pair"], batch["doc_id"], batch["source"], target, pack)
    elif task == "chat":
        rows = chat_rows(tokenizer, batch["messages"], batch["doc_id"], batch["source"], target, chat_loss,
                         truncation, pack)
    elif task == "pretrain":
        eos = tokenizer.eos_token_id if add_eos else None
        encoded = tk.encode(tokenizer, batch["text"], special=True)["input_ids"]  # BOS where the model uses one
        for ids, doc_id, source in zip(encoded, batch["doc_id"], batch["source"]):
            ids = ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids
            rows += pretrain_rows(ids, target, overlap, doc_id, source)
        rows = pack_rows(rows, target) if pack else rows
    else:
        enc = tk.encode(tokenizer, batch["document"], offsets=True)
        sep = tk.encode(tokenizer, [_SEP])["input_ids"][0]
        for doc, offsets, doc_id, source, qas in zip(enc["input_ids"], enc["offset_mapping"], batch["doc_id"],
                                                     batch["source"], batch["qas"]):
            ends = tk.token_ends(offsets)
            spans = [[(tk.char_to_token(ends, a), tk.char_to_token(ends, b - 1) + 1) for a, b in qa["spans"]]
                     for qa in qas]
            for epoch in range(epochs):
                order = list(range(len(qas)))
                random.Random(f"{seed}:{epoch}:{doc_id}").shuffle(order)
                for group in _groups(tokenizer, doc, qas, spans, order, target, len(sep), questions_per_row,
                                     use_chat_template):
                    rows.append(_qa(tokenizer, doc, [qas[i] for i in group], [s for i in group for s in spans[i]],
                                    doc_id, source, target, sep, seed, epoch, use_chat_template))
    for row in rows:
        row.setdefault("error", "")
        row["num_tokens"] = len(row["input_ids"])
        row["num_loss_tokens"] = sum(1 for x in row["labels"][1:] if x != -100)  # position 0 is never scored
    return {key: [row[key] for row in rows] for key in (rows[0] if rows else {"error": None})}


def _groups(tokenizer: Any, doc: list[int], qas: list[dict], spans: list[list[tuple[int, int]]], order: list[int],
            target: int, sep_len: int, per_row: int | None, use_chat_template: bool | None) -> list[list[int]]:
    """Questions (indices, in `order`) grouped into rows: first fit, each group's turns and evidence within
    `target`. A question that does not fit even alone gets a group of its own (its row reports the error)."""
    chat = use_chat_template
    head, _ = qa_turns(tokenizer, [(qas[0]["question"], qas[0]["answer"])], use_chat_template=chat)
    # Turn lengths as the first turn of a row (the evaluation prompt) and as a later turn: the chat template's
    # later user turns lack the instruction, so each question has two sizes.
    sizes = []
    for q in qas:
        _, (t0,) = qa_turns(tokenizer, [(q["question"], q["answer"])], use_chat_template=chat)
        _, (_, t1) = qa_turns(tokenizer, [("?", "-"), (q["question"], q["answer"])], use_chat_template=chat)
        sizes.append((len(t0.prompt) + len(t0.answer), len(t1.prompt) + len(t1.answer)))

    def fits(group: list[int]) -> bool:
        budget = target - len(head) - sizes[group[0]][0] - sum(sizes[i][1] for i in group[1:])
        try:
            evidence_pieces(len(doc), budget, [s for i in group for s in spans[i]], random.Random(0), sep_len)
        except ValueError:
            return False
        return True

    groups, left = [], list(order)
    while left:
        group = [left[0]]
        for i in left[1:] if fits(group) else []:
            if per_row is not None and len(group) >= per_row:
                break
            if fits(group + [i]):
                group.append(i)
        groups.append(group)
        left = [i for i in left if i not in group]
    return groups


def _qa(tokenizer: Any, doc: list[int], qas: list[dict], spans: list[tuple[int, int]], doc_id: str, source: str,
        target: int, sep: list[int], seed: int, epoch: int, use_chat_template: bool | None) -> dict[str, Any]:
    prefix, turns = qa_turns(tokenizer, [(q["question"], q["answer"]) for q in qas],
                             use_chat_template=use_chat_template)
    budget = target - len(prefix) - sum(len(t.prompt) + len(t.answer) for t in turns)
    ids = [q["qa_id"] for q in qas]
    # Epoch 0 keeps the window placement of one-question rows made before multi-question rows existed.
    rng = random.Random(f"{seed}:{ids[0]}" if epoch == 0 else f"{seed}:{epoch}:{ids[0]}")
    meta = {"qa_id": ids[0], "kind": qas[0]["kind"], "qa_ids": ids, "kinds": [q["kind"] for q in qas], "epoch": epoch}
    try:
        pieces = evidence_pieces(len(doc), budget, spans, rng, len(sep))
    except ValueError as e:
        return {"input_ids": [], "labels": [], "position_ids": [], "cu_seqlens": [0, 0], "doc_ids": [doc_id],
                "sources": [source], "token_starts": [0], "doc_pieces": [], "doc_span": [0, 0], **meta,
                "error": f"{source}: question {ids[0]}: {e}"}
    row_ids, labels = qa_turns_row(prefix, doc, pieces, sep, [(t.prompt, t.answer) for t in turns])
    row = segment_row(row_ids, labels, doc_id, source, pieces[0][0])
    # where the document (its pieces and separators) lies in the row: a mix can put a loss on those tokens too
    body = sum(b - a for a, b in pieces) + len(sep) * (len(pieces) - 1)
    row.update(doc_pieces=[list(p) for p in pieces], doc_span=[len(prefix), len(prefix) + body], **meta)
    return row
