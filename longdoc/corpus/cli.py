"""`longdoc data synth`, `prepare`, `plant`, `pairs` and `rehearse`.

    longdoc data synth --domain legal --num-docs 4 --tokens 32768 --seed 0 --out legal.jsonl
    longdoc data synth --domain legal --num-docs 8 --tokens 4096 --chat --out legal-chat.jsonl   # conversations
    longdoc data prepare legal.jsonl --task qa --target-tokens 32768 --out runs/data/legal-qa
    longdoc data prepare legal.jsonl --task qa --target-tokens 4096 --questions-per-row 4 --epochs 3 --out qa.jsonl
    longdoc data prepare notes/ --task pretrain --target-tokens 65536 --skip-bad --out notes.parquet
    longdoc data prepare chats.jsonl --task chat --target-tokens 32768 --pack --out chats.parquet
    longdoc data rehearse --model SmolLM2-135M-Instruct --samples 64 --out runs/data/rehearsal.jsonl
    longdoc data pairs legal.jsonl --chat --out legal-pairs.jsonl      # preference pairs (longdoc.corpus.pairs)
    longdoc data prepare legal-pairs.jsonl --task preference --target-tokens 32768 --out pairs.parquet

Heavy imports (tokenizers, datasets) happen inside the handlers so `longdoc --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from longdoc import cliargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="generate synthetic documents or tokenize a corpus",
                       description="Documents in, token sequences out. See data/README.md for the formats.")
    verbs = p.add_subparsers(dest="data_verb", metavar="COMMAND", required=True)
    for add in (_add_synth, _add_prepare, _add_plant, _add_pairs, _add_rehearse):
        add(verbs)


def _add_synth(verbs: argparse._SubParsersAction) -> None:
    s = verbs.add_parser("synth", help="generate legal case files or patient histories with QA pairs",
                         description="Synthetic long documents with planted facts and checkable questions "
                                     "(one JSON record per line).")
    s.add_argument("--domain", required=True, choices=["legal", "medical"])
    s.add_argument("--num-docs", type=int, default=4)
    s.add_argument("--tokens", type=cliargs.length, default=32768, help="document length in the tokenizer's tokens "
                   "(4096-131072 intended; 1024-1048576 accepted; within 1%% from 4096)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    s.add_argument("--qa-per-kind", type=int, default=2, help="questions per kind per document (default 2)")
    s.add_argument("--chat", action="store_true", help="write each document as a conversation instead: the "
                   "document and its first question in a user turn, then one user/assistant turn per question "
                   "(`data prepare --task chat`, recipe data.task: chat)")
    s.add_argument("--out", required=True, help="output .jsonl file")
    s.set_defaults(func=_synth)


def _add_prepare(verbs: argparse._SubParsersAction) -> None:
    q = verbs.add_parser("prepare", help="tokenize documents into training rows",
                         description="Tokenize jsonl/json/parquet/csv files, documents (.txt, .md, .pdf, .docx, "
                                     ".html; PDF and DOCX need `pip install 'longdoc[docs]'`) and folders of them, "
                                     "or hub dataset ids into rows of input_ids/labels/position_ids. Every file of a "
                                     "folder is read or named in an error (with --skip-bad: in the report); a "
                                     "scanned PDF without a text layer is an error (OCR it first, e.g. ocrmypdf).")
    q.add_argument("inputs", nargs="+", help="data files, documents (.txt/.md/.pdf/.docx/.html) and folders of "
                   "them, or hub dataset ids")
    q.add_argument("--out", required=True, help="a .jsonl or .parquet file, or a folder (save_to_disk)")
    q.add_argument("--task", choices=["pretrain", "qa", "chat", "preference"], default="pretrain",
                   help="pretrain: whole documents; qa: document + question -> answer; chat: conversations "
                        "(messages [{role, content}] or ShareGPT conversations) in the model's chat template; "
                        "preference: prompt/chosen/rejected pairs (TRL's text or conversational format) as "
                        "shared-prefix rows (default pretrain)")
    q.add_argument("--tokenizer", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    q.add_argument("--target-tokens", type=cliargs.length, default=32768,
                   help="row length (default 32768, up to 1048576; 32k and 1M work too)")
    q.add_argument("--overlap", type=int, default=None, help="overlap of windows over long documents "
                   "(default: target/8)")
    q.add_argument("--pack", action="store_true", help="pack short documents into one row (pretrain, chat, "
                   "preference; off by "
                   "default; under `longdoc train` each document attends only to itself and keeps its own positions)")
    q.add_argument("--loss-on", choices=["assistant", "all"], default="assistant", help="chat: loss on the "
                   "assistant turns only (default) or on every token")
    q.add_argument("--truncation", choices=["left", "right"], default="left", help="chat: a conversation longer "
                   "than --target-tokens loses content of its non-trained turns, longest first, from their start "
                   "(left, default) or end (right); trained assistant turns are never cut")
    q.add_argument("--no-chat-template", action="store_true", help="qa: plain-text prompt even if the "
                   "tokenizer has a chat template")
    for name, default in (("text", None), ("document", "document"), ("question", "question"),
                          ("answer", "answer"), ("qa", "qa"), ("evidence", "evidence"), ("id", "id")):
        q.add_argument(f"--{name}-field", default=default,
                       help=f"field name (default: {default or 'first of text/document/content'})")
    q.add_argument("--split", default="train", help="split of a hub dataset (default train)")
    q.add_argument("--skip-bad", action="store_true", help="skip bad records, questions and files (unsupported "
                   "or unreadable files in a folder, scanned PDFs) and report them at the end instead of stopping at "
                   "the first")
    q.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes (datasets.map)")
    q.add_argument("--cache-dir", default=None, help="cache folder (default: the datasets cache)")
    q.add_argument("--seed", type=int, default=0, help="question order and placement of QA windows")
    q.add_argument("--questions-per-row", type=int, default=None, help="qa: at most this many questions "
                   "(turns) per row (default: all of a document's questions that fit in --target-tokens)")
    q.add_argument("--epochs", type=int, default=1, help="qa: passes over the documents to write, each with "
                   "its own question order and windows (default 1)")
    q.set_defaults(func=_prepare)


def _add_plant(verbs: argparse._SubParsersAction) -> None:
    t = verbs.add_parser("plant", help="plant artificial retrieval facts and their questions in documents",
                         description="Each document of a QA jsonl (`longdoc data synth` records) gets --facts key-value"
                                     " sentences at random sentence boundaries and one question per fact (kind "
                                     "retrieval), in a vocabulary of its own (longdoc.corpus.plant): training on them "
                                     "keeps the skill of finding a fact anywhere in a long context. With --windows, "
                                     "the inputs are plain documents instead (your own unlabelled text: any file or "
                                     "folder `data prepare` reads), cut into windows that get only the planted "
                                     "facts' questions: retrieval rows in real text of your kind.")
    t.add_argument("input", nargs="+", help="QA records (.jsonl); with --windows, documents or folders of them")
    t.add_argument("--facts", type=int, default=4, help="facts per document (default: %(default)s)")
    t.add_argument("--windows", type=cliargs.length, default=None, metavar="TOKENS",
                   help="read plain documents and cut each into windows of about TOKENS tokens (e.g. 3k for rows "
                        "of 4k, leaving room for the questions)")
    t.add_argument("--per-document", type=int, default=1, help="with --windows: windows taken from the start of "
                   "each document (default: %(default)s; more documents beat more windows of one)")
    t.add_argument("--skip-bad", action="store_true", help="with --windows: skip unsupported or unreadable files of "
                   "a folder and name them at the end, as `data prepare --skip-bad` does")
    t.add_argument("--tokenizer", default=None, help="with --windows: model name or path whose tokens count "
                   "(default: SmolLM2-135M-Instruct)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True, help="output .jsonl file")
    t.set_defaults(func=_plant)


def _add_pairs(verbs: argparse._SubParsersAction) -> None:
    t = verbs.add_parser("pairs", help="preference pairs from QA records: the gold answer chosen, a wrong one rejected",
                         description="One {prompt, chosen, rejected} row per question of QA records (`longdoc data "
                                     "synth` output, or any file `data prepare --task qa` reads): chosen is the gold "
                                     "answer, rejected another value of the same document (a value written where the "
                                     "answer is written, or the answer of a neighbouring question of the same kind), "
                                     "or with --model that model's own wrong answer (longdoc.corpus.pairs). "
                                     "Tokenize the output with `data prepare --task preference`.")
    t.add_argument("inputs", nargs="+", help="QA records (.jsonl and what `data prepare --task qa` reads)")
    t.add_argument("--out", required=True, help="output .jsonl file")
    t.add_argument("--chat", action="store_true", help="write TRL's conversational format (message lists) instead "
                   "of the text format")
    t.add_argument("--model", default=None, help="on-policy: the rejected answer is this model's own (wrong) answer")
    t.add_argument("--temperature", type=float, default=0.0, help="with --model: 0 decodes greedily (default), "
                   "above 0 samples once per question")
    t.add_argument("--seed", type=int, default=0, help="with --model and --temperature: the sampling seed")
    t.add_argument("--max-new-tokens", type=int, default=32, help="with --model: answer length (default: %(default)s)")
    t.add_argument("--skip-bad", action="store_true", help="skip bad records and questions and name them at the "
                   "end, as `data prepare --skip-bad` does")
    t.set_defaults(func=_pairs)


def _add_rehearse(verbs: argparse._SubParsersAction) -> None:
    r = verbs.add_parser("rehearse", help="sample replay text from the base model itself (a data.mix rehearsal source)",
                         description="Self-synthesised rehearsal (longdoc.corpus.rehearsal): the model writes user "
                                     "requests and answers them, sampled at temperature 1, one {doc_id, text} record "
                                     "per line. Point a data.mix source {source: rehearsal, path: OUT} at the file.")
    r.add_argument("--model", default="SmolLM2-135M-Instruct", help="the base model (default: %(default)s)")
    r.add_argument("--samples", type=int, default=64, help="conversations (default: %(default)s)")
    r.add_argument("--max-new-tokens", type=cliargs.length, default=384, help="tokens per turn (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True, help="output .jsonl file")
    r.set_defaults(func=_rehearse)


def _synth(args: argparse.Namespace) -> int:
    from longdoc.corpus.synth import synthesize, write_jsonl

    t0 = time.perf_counter()
    try:
        records = synthesize(args.domain, args.num_docs, args.tokens, args.seed, args.tokenizer, args.qa_per_kind)
    except ValueError as e:
        print(f"longdoc data synth: {e}", file=sys.stderr)
        return 2
    if args.chat:
        from longdoc.corpus.chat import qa_conversation

        write_jsonl([qa_conversation(r) for r in records], args.out)
    else:
        write_jsonl(records, args.out)
    lengths = [r["num_tokens"] for r in records]
    kinds = sorted({q["kind"] for r in records for q in r["qa"]})
    print(f"wrote {len(records)} {args.domain} documents to {args.out} in {time.perf_counter() - t0:.1f}s: "
          f"{min(lengths)}-{max(lengths)} tokens (target {args.tokens}), "
          f"{sum(len(r['qa']) for r in records)} questions of {len(kinds)} kinds ({', '.join(kinds)})")
    return 0


def _plant(args: argparse.Namespace) -> int:
    from longdoc.corpus import plant
    from longdoc.corpus.synth import write_jsonl

    try:
        if args.facts < 1:
            raise ValueError(f"--facts must be >= 1, got {args.facts}")
        records = _plant_inputs(args)
        planted = [plant.plant(r, args.facts, args.seed) for r in records]
    except (OSError, ValueError) as e:
        print(f"longdoc data plant: {e}", file=sys.stderr)
        return 2
    write_jsonl(planted, args.out)
    print(f"wrote {len(planted)} documents to {args.out}, {args.facts} retrieval facts and questions planted in each")
    return 0


def _plant_inputs(args: argparse.Namespace) -> list[dict]:
    """QA records as they are, or (--windows) windows of plain documents with no questions of their own."""
    import json

    from longdoc.corpus import plant

    if args.windows is None:
        records = []
        for path in args.input:
            with open(path, encoding="utf-8") as f:
                try:
                    records += [json.loads(line) for line in f if line.strip()]
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} is not QA records (JSON lines: {e}); for plain documents pass "
                                     f"--windows TOKENS") from None
        if not records or not all(isinstance(r, dict) and "document" in r for r in records):
            raise ValueError(f"{' '.join(args.input)} holds no QA records with a document (make them with `longdoc "
                             f"data synth`, or pass --windows TOKENS for plain documents)")
        return records
    from pathlib import Path

    from longdoc import models
    from longdoc.corpus.ingest import Skips, read_documents

    skips = Skips() if args.skip_bad else None
    texts = [(Path(d["doc_id"]).stem, d["text"]) for d in read_documents(args.input, task="pretrain", skips=skips)]
    if skips is not None and skips.total:
        print(skips.report(), file=sys.stderr)
    records = plant.windows(texts, args.windows, args.per_document, models.load_tokenizer(args.tokenizer
                                                                                        or models.DEFAULT_MODEL))
    if not records:
        raise ValueError(f"no document of {' '.join(args.input)} holds a window of {args.windows} tokens; pass "
                         f"longer documents or a smaller --windows")
    return records


def _pairs(args: argparse.Namespace) -> int:
    from longdoc.corpus import pairs
    from longdoc.corpus.ingest import CorpusError, Skips, read_documents
    from longdoc.corpus.synth import write_jsonl

    skips = Skips() if args.skip_bad else None
    t0 = time.perf_counter()
    try:
        if args.temperature < 0 or args.max_new_tokens < 1:
            raise ValueError(f"--temperature must be >= 0 and --max-new-tokens >= 1, got {args.temperature} and "
                             f"{args.max_new_tokens}")
        records = list(read_documents(args.inputs, task="qa", keep=pairs.KEEP, skips=skips))
        if not records:
            raise ValueError(f"{' '.join(args.inputs)} holds no usable QA records"
                             + (f" ({skips.summary()})" if skips is not None else ""))
        answers = None
        if args.model:
            from longdoc import models

            model, tokenizer = models.load(args.model)
            answers = pairs.model_answers(model.eval(), tokenizer, records, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, seed=args.seed, chat=args.chat)
        rows, made, skipped = pairs.build(records, chat=args.chat, answers=answers)
    except (CorpusError, ValueError, OSError) as e:
        print(f"longdoc data pairs: {e}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} pairs ({'conversational' if args.chat else 'text'} format) from {len(records)} "
          f"documents to {args.out} in {time.perf_counter() - t0:.1f}s")
    print(pairs.counts_line(made, skipped))
    if skips is not None:
        print(skips.report(), file=sys.stderr if skips.total else sys.stdout)
    if not rows:
        print("longdoc data pairs: no pair made (see the counts above)", file=sys.stderr)
        return 1
    return 0


def _rehearse(args: argparse.Namespace) -> int:
    from pathlib import Path

    from longdoc import models
    from longdoc.corpus import rehearsal

    if args.samples < 1 or args.max_new_tokens < 1:
        print("longdoc data rehearse: --samples and --max-new-tokens must be positive", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    tokenizer = models.load_tokenizer(args.model)
    texts = rehearsal.generate(args.model, tokenizer, samples=args.samples, max_new_tokens=args.max_new_tokens,
                               seed=args.seed)
    rehearsal.write(texts, Path(args.out))
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    print(f"wrote {len(texts)} samples of {args.model} to {args.out} in {time.perf_counter() - t0:.1f}s: "
          f"{tokens} tokens")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from longdoc.corpus.ingest import CorpusError, Fields, Skips
    from longdoc.corpus.prepare import prepare, save

    fields = Fields(text=args.text_field, document=args.document_field, question=args.question_field,
                    answer=args.answer_field, qa=args.qa_field, evidence=args.evidence_field, id=args.id_field)
    skips = Skips() if args.skip_bad else None
    t0 = time.perf_counter()
    try:
        ds = prepare(args.inputs, args.tokenizer, task=args.task, target_tokens=args.target_tokens,
                     overlap=args.overlap, pack=args.pack, fields=fields, skips=skips, num_proc=args.num_proc,
                     cache_dir=args.cache_dir, split=args.split, seed=args.seed,
                     use_chat_template=False if args.no_chat_template else None,
                     questions_per_row=args.questions_per_row, epochs=args.epochs, chat_loss=args.loss_on,
                     truncation=args.truncation)
    except (CorpusError, ValueError) as e:
        print(f"longdoc data prepare: {e}", file=sys.stderr)
        return 2
    kind = save(ds, args.out)
    tokens, loss = sum(ds["num_tokens"]), sum(ds["num_loss_tokens"])
    docs = len({d for ids in ds["doc_ids"] for d in ids})
    print(f"wrote {len(ds)} rows from {docs} documents to {args.out} ({kind}) in {time.perf_counter() - t0:.1f}s: "
          f"{tokens} tokens, {loss} with loss, rows of at most {max(ds['num_tokens'], default=0)} tokens")
    if args.task == "chat":
        from longdoc.corpus.chat import parts_summary

        print(parts_summary(ds.select_columns([c for c in ds.column_names if c.endswith("_tokens") or
                                               c == "chat_parts"]).to_dict()))
    if skips is not None:
        print(skips.report(), file=sys.stderr if skips.total else sys.stdout)
    return 0
