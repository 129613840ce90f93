"""`longdoc ask`: questions about your own documents, answered from one context-parallel prefill.

    longdoc ask MODEL FILE [FILE ...] [--question Q ...] [--cp N]
    longdoc ask SmolLM2-135M-Instruct contract.pdf --question "Where is the Supplier based?" --question "Who pays?"
    longdoc ask runs/mine/pretrain/final my_contracts/ --cp 2        # a prompt: answers streamed, Ctrl-D quits
    longdoc ask SmolLM2-135M-Instruct long_report.docx --rope-type yarn --rope-factor 2 --cp 4   # past 8k tokens

FILE is anything `longdoc data prepare` reads: .txt/.md/.pdf/.docx/.html files and folders of them, jsonl/json/
parquet/csv with a text field. Their documents, in order, make ONE document, prefilled once under context
parallelism (--cp N spawns N local gloo ranks; under a launcher every process is one rank). Every question is
answered from that prefill with the prompt `longdoc eval qa` uses (the chat template when the tokenizer has one),
by greedy decoding.

With --question (repeatable) the answers are printed and the command exits; the questions are decoded together
over the one prefill. Without it a prompt opens: line editing and history, each answer streamed as it is
generated, Ctrl-C stops that answer (not the program), Ctrl-D quits. The prefill's tokens and seconds go to
stderr (`prefill: 12,345 tokens in 3.2 s (cp=2)`), the answers to stdout.

Bad input is found before any rank starts or any weights load, and is one line on stderr with exit status 2: a
missing or unreadable file, an unsupported file type, a document longer than the model's context (the line
names the --rope-type/--rope-factor that fits it), a prefill larger than the memory of one rank (priced from the
model's config: the line names the smallest --cp that fits; local CPU ranks share this host's memory and each holds
the weights, so there it names the ranks across nodes that would). --skip-bad leaves out the files longdoc cannot
read and names each on stderr instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from longdoc import cliargs
from longdoc.ask import fit
from longdoc.eval.cli import common_args

_SHORTEN = "ask about fewer or shorter files"
_FILES = ".txt/.md/.pdf/.docx/.html files or folders of them, or jsonl/json/parquet/csv with a text field"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ask", help="ask questions about your own documents: one CP prefill, answers streamed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model name, folder, .gguf, hub id or tiny:<arch>")
    p.add_argument("files", nargs="+", metavar="FILE", help=f"the document(s): {_FILES}")
    p.add_argument("--question", action="append", default=None, metavar="Q",
                   help="a question to answer (repeatable); without any, an interactive prompt opens")
    p.add_argument("--max-new-tokens", type=cliargs.length, default=64,
                   help="answer length cap (default: %(default)s)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the tokenizer has one)")
    p.add_argument("--batch", type=_positive, default=16,
                   help="--question answers decoded together over the one prefill; 1 decodes them one at a time "
                        "(same answers up to rounding) (default: %(default)s)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out files longdoc cannot read (an image in a folder, a scanned PDF without text) and "
                        "name each on stderr, as `longdoc data prepare --skip-bad` does, instead of stopping at the "
                        "first")
    common_args(p, model=False, out=False)
    p.set_defaults(func=_run)


def prepare(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the document's prompt ids ("prefix_ids"), after every check that needs no weights: the files
    exist and read, the questions are not empty, the prompt plus question and answer fit the model's context, the
    prefill fits the memory of one rank at --cp (longdoc.ask.fit)."""
    from longdoc import models
    from longdoc.corpus.ingest import Skips
    from longdoc.eval.data import read_texts
    from longdoc.eval.prompts import Prompter
    from longdoc.runtime.launch import launched_world
    from longdoc.train.recipe_parse import RecipeError

    for path in cfg["files"]:
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} does not exist (give {_FILES})")
    questions = cfg.get("question") or []
    if any(not q.strip() for q in questions):
        raise ValueError("--question is empty; give the question's text, e.g. --question \"Who signed it?\"")
    skips = Skips() if cfg.get("skip_bad") else None
    document = "\n\n".join(t.strip() for t in read_texts(list(cfg["files"]), skips=skips) if t.strip())
    if not document:
        raise ValueError(f"{_names(cfg['files'])}: no text to ask about"
                         + (f" ({skips.summary()})" if skips is not None and skips.total else ""))
    if skips is not None and launched_world().is_main:  # every rank of a launcher reads them: one of them says so
        for message in skips.messages:
            print(f"longdoc ask: skipped {message}", file=sys.stderr)
    prompter = Prompter(models.load_tokenizer(cfg["model"]), chat=cfg.get("chat"))
    prefix = prompter.prefix(document)
    asked = max((len(prompter.suffix(q)) for q in questions), default=0) + cfg["max_new_tokens"]
    memory = fit.check(cfg, len(prefix))
    check_length(cfg, len(prefix) + asked, f"{_names(cfg['files'])}: the document's prompt of {len(prefix)} tokens "
                                           f"plus question and answer ({asked} more)",
                 also=None if memory is None or memory.fits else memory.also())
    if memory is not None and not memory.fits:
        raise RecipeError(memory.refusal(f"{_names(cfg['files'])}: the document's prompt of {len(prefix)} tokens",
                                         shorten=_SHORTEN))
    return {**cfg, "prefix_ids": prefix}


def _names(files: list[str]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def check_length(cfg: dict[str, Any], tokens: int, what: str, also: str | None = None) -> None:
    """Refuse `tokens` positions past the model's context (after --rope-type/--rope-factor), from its config alone;
    the line names the RoPE extension that fits them, and `also` (the --cp the prefill's memory needs) after it."""
    from longdoc.train.config import ModelConfig
    from longdoc.train.modeling import check_context
    from longdoc.train.preflight import model_context

    mcfg = ModelConfig(name=cfg["model"], rope_type=cfg.get("rope_type"),
                       rope_factor=float(cfg.get("rope_factor") or 1.0))
    extend = ("--rope-type yarn --rope-factor {factor}" if mcfg.rope_type is None else
              f"a larger --rope-factor than {cfg.get('rope_factor')}")
    if also:
        extend += f" and {also.replace('{', '{{').replace('}', '}}')}"
    check_context(tokens, model_context(mcfg), what=what, extend=extend, shorten=_SHORTEN)


def _run(args: argparse.Namespace) -> int:
    from longdoc.ask import answer, console
    from longdoc.eval.cli import config
    from longdoc.eval.runner import run

    cfg = prepare(config(args))
    if not cfg.get("question"):
        return console.interactive(cfg, answer.job)
    result = run(answer.job, cfg)
    if result is not None:  # the process that prints: rank 0, or the parent of spawned ranks
        print(console.prefill_line(result), file=sys.stderr, flush=True)
        for question, text in zip(cfg["question"], result["answers"]):
            print(f"Q: {question}\nA: {text}\n", flush=True)
    return 0
