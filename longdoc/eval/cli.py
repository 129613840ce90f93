"""`longdoc eval qa | needle | position-loss | chat-loss | ruler | compare | guard`: long-document evaluation under CP.

    longdoc eval qa --model SmolLM2-135M-Instruct --data legal.jsonl medical.jsonl --cp 2
    longdoc eval needle --model runs/demo/final --domain legal --lengths 1024,2048,4096 --cp 2
    longdoc eval needle --model M --haystack my_contracts/ --lengths 4k,8k --cp 2      # your own documents
    longdoc eval position-loss --model runs/demo/final --data legal.jsonl --length 4096 --cp 2
    longdoc eval chat-loss --model runs/chat/final --data held-out-chats.jsonl --length 4k --cp 2   # chat data
    longdoc eval ruler --model runs/demo/final --lengths 2k,4k,8k --samples 100 --cp 2   # RULER-style suite
    longdoc eval qa --model SmolLM2-135M-Instruct --data long.jsonl --rope-type yarn --rope-factor 2  # past 8k
    longdoc eval compare runs/eval/qa-base runs/eval/qa-tuned           # two run folders, or two models:
    longdoc eval compare SmolLM2-135M-Instruct runs/demo/final --names base tuned --data qa.jsonl --cp 2
    longdoc eval compare SmolLM2-135M-Instruct runs/demo/final --tasks ruler --lengths 2k,4k,8k --cp 2
    longdoc eval guard SmolLM2-135M-Instruct runs/demo/final --text heldout_docs/ --cp 2   # did tuning harm it?

--data / --haystack read every format `longdoc data prepare` reads (jsonl/json/parquet/csv, .txt/.md/.pdf/
.docx/.html files and folders of them, hub ids). A prompt longer than the model's context is refused before
any compute; lengths take k/M suffixes (4k = 4096). --skip-bad (qa, needle, ruler, compare: one flag for --data
and --haystack) leaves out bad records and files longdoc cannot read (an image in a folder) and names each at the
end, as `longdoc data prepare --skip-bad` does; without it the first one stops the run, by name.

--cp N on one machine spawns N local gloo ranks. Under a launcher (`accelerate launch --multi_gpu
--num_processes N -m longdoc eval ...` or torchrun) every process is one rank and --cp must equal N.
Each run writes one folder (default runs/eval/<task>-<model>-<time>) with results.json, summary.md
and PNGs, and prints its headline numbers (QA: EM, F1, answer NLL; needle: mean accuracy; position-loss:
mean loss, first and last bucket; ruler: the average over tasks, per length) and the folder's path.

`guard` is the no-harm check before shipping a tuned model (longdoc.eval.guard): BASE and TUNED on your own
held-out plain text (needle grid planted in it, plain-text loss by position, optionally a short RULER-style
subset), paired 95% bootstrap intervals of tuned minus base, and one verdict line; exit 0 NO HARM, 1 HARM,
2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from longdoc import cliargs
from longdoc.models import zoo
from longdoc.parallel import strategy as registry
from longdoc.parallel.layout import LAYOUTS


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def common_args(p: argparse.ArgumentParser, model: bool = True, out: bool = True) -> None:
    """The options every command that loads a model onto CP ranks shares (eval, `longdoc ask`)."""
    if model:
        p.add_argument("--model", default="SmolLM2-135M-Instruct",
                       help=f"model name, folder, .gguf, hub id or tiny:<arch> ({', '.join(zoo.NAMES)}; "
                            f"`longdoc verify --help` says which patterns each has) (default: %(default)s)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (default: %(default)s)")
    if out:
        p.add_argument("--out", default=None, help="run folder (default: runs/eval/<task>-<model>-<time>)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto = CUDA under a launcher when available, else CPU")
    p.add_argument("--strategy", default="ring", choices=registry.names(), help="CP attention for the prefill")
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="with --strategy usp: ranks per Ulysses group (a divisor of --cp; ring across the groups)")
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS)
    p.add_argument("--threads", type=int, default=None, help="torch threads per spawned rank (default: cores / cp)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds any collective may wait (default: %(default)s)")
    p.add_argument("--rope-type", default=None, choices=("linear", "yarn"),
                   help="extend RoPE past the model's context, as training's model.rope_type does (default: as the "
                        "model's config says)")
    p.add_argument("--rope-factor", type=float, default=None,
                   help="context multiplier with --rope-type, as training's model.rope_factor (e.g. 2)")


def _qa_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--data", nargs="+", required=required,
                   help="QA documents: `longdoc data synth` jsonl, or any file `longdoc data prepare --task qa` reads "
                        "({document, qa: [...]} or flat {document, question, answer} records; answers are found in "
                        "the document up to case and whitespace)")
    p.add_argument("--max-new-tokens", type=cliargs.length, default=64, help="answer length cap (default: %(default)s)")
    p.add_argument("--limit-docs", type=int, default=None, help="first N documents per file")
    p.add_argument("--limit-questions", type=int, default=None, help="first N questions per document")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template (default: when the tokenizer has one)")
    p.add_argument("--qa-batch", type=_positive, default=16,
                   help="qa: questions of one document decoded together over its one prefill; 1 decodes them one "
                        "at a time (same answers up to rounding) (default: %(default)s)")


def _skip_bad(p: argparse.ArgumentParser, what: str) -> None:
    """The one --skip-bad of an eval command, for every input it reads (`what`)."""
    p.add_argument("--skip-bad", action="store_true",
                   help=f"leave out {what} and name each at the end, as `longdoc data prepare --skip-bad` does, "
                        "instead of stopping at the first")


def _needle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--domain", default="legal", choices=("legal", "medical", "general"),
                   help="the needle sentences and the generated filler: legal or medical; general: ten sentences "
                        "about everyday things, on --haystack (your own text; the set `eval guard` plants)")
    p.add_argument("--lengths", type=cliargs.lengths, default=[1024, 2048, 4096],
                   help="context lengths, e.g. 1k,2k,4k (needle; in compare also ruler's)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--repeats", type=int, default=1, help="needles per cell (different values and haystacks)")
    p.add_argument("--haystack", nargs="+", default=None, metavar="FILE|FOLDER",
                   help="your own documents as the haystack (any format `longdoc data prepare` reads: .txt/.md/.pdf/"
                        ".docx/.html files and folders of them, jsonl/json/parquet/csv); default: generated --domain "
                        "documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle-batch", type=_positive, default=8,
                   help="needle: cells whose prompts have the same token count decoded together, one prefill and one "
                        "greedy decode, at most this many rows and 32k prompt tokens a group; 1 decodes one cell at "
                        "a time (same answers up to rounding) (default: %(default)s)")


def _ruler_args(p: argparse.ArgumentParser, alone: bool) -> None:
    from longdoc.eval.ruler import generate

    if alone:  # in `compare`, --lengths, --seed and --chat are shared with needle and qa
        p.add_argument("--lengths", type=cliargs.lengths, default=generate.DEFAULT_LENGTHS,
                       help="context lengths, prompt plus answer budget, e.g. 2k,4k,8k (default: 4k)")
        p.add_argument("--seed", type=int, default=0, help="the samples' seed (default: %(default)s)")
        p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                       help="use the chat template (default: when the tokenizer has one)")
        p.add_argument("--haystack", nargs="+", default=None, metavar="FILE|FOLDER",
                       help="ruler: your own documents as the needle tasks' filler (any format `longdoc data "
                            "prepare` reads), instead of --ruler-haystack")
    p.add_argument("--samples", type=int, default=generate.DEFAULT_SAMPLES,
                   help="ruler: samples per task and length (default: %(default)s)")
    p.add_argument("--ruler-tasks", default="all",
                   help=f"ruler: comma-separated subset of {', '.join(generate.TASKS)} (default: all)")
    p.add_argument("--ruler-haystack", default="prose", choices=generate.HAYSTACKS,
                   help="ruler: the needle tasks' filler, generated prose or RULER's repeated noise (default: prose; "
                        "--haystack FILE|FOLDER: your own documents)")
    p.add_argument("--batch-size", default="auto",
                   help=f"ruler: prompts per forward; auto = {generate.BATCH_TOKENS} // length, 1 to 16 "
                        "(default: auto)")


def _position_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=cliargs.length, default=None,
                   help="tokens per document (longer ones are cut; default: the shortest document)")
    p.add_argument("--buckets", type=int, default=16, help="position buckets (default: %(default)s)")
    p.add_argument("--num-docs", type=int, default=4, help="documents to generate when --pl-data is not given")
    p.add_argument("--pl-data", nargs="+", default=None, dest="pl_data",
                   help="documents: jsonl/json/parquet/csv with text/document/content, or .txt/.md/.pdf/.docx/.html "
                        "files or a folder of them (default: generated --domain documents)")


def _guard_args(p: argparse.ArgumentParser) -> None:
    from longdoc.eval import harm

    p.add_argument("base", help="the base model (name, folder, .gguf, hub id, tiny:<arch>), or a run folder of an "
                                "earlier guard (its base/ is reused, not evaluated again)")
    p.add_argument("tuned", help="the fine-tuned model (or a run folder)")
    p.add_argument("--text", required=True, metavar="FILE|FOLDER",
                   help="your held-out plain text: .txt/.md/.pdf/.docx/.html files or a folder of them (any input "
                        "`longdoc data prepare` reads); never trained on")
    p.add_argument("--lengths", type=cliargs.lengths, default=[1024, 2048],
                   help="1 to 3 needle context lengths; the plain-text windows have the longest (default: 1k,2k)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)")
    p.add_argument("--repeats", type=int, default=None,
                   help="needles per cell (default: enough for 20 paired cells; 2 with the default grid)")
    p.add_argument("--seed", type=int, default=0, help="needle values and RULER samples (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=cliargs.length, default=32,
                   help="needle answer length cap (default: %(default)s)")
    p.add_argument("--needle-batch", type=_positive, default=8,
                   help="needle cells with prompts of one token count decoded together (as `eval needle`; 1: one at a "
                        "time) (default: %(default)s)")
    p.add_argument("--windows", type=int, default=16,
                   help="plain-text loss: at most this many windows of the longest length (default: %(default)s)")
    p.add_argument("--buckets", type=int, default=16, help="plain-text loss: position buckets (default: %(default)s)")
    p.add_argument("--ruler-samples", type=int, default=None, metavar="N",
                   help="also run a short RULER-style subset, N samples per task and length (lengths >= 1k; "
                        "default: off)")
    p.add_argument("--ruler-tasks", default="all", help="with --ruler-samples: a comma-separated subset (default: all)")
    p.add_argument("--needle-tolerance", type=float, default=harm.NEEDLE_TOLERANCE,
                   help="needle and ruler: HARM when the accuracy delta's upper bound < 0 and the drop exceeds this "
                        "(absolute; default: %(default)s)")
    p.add_argument("--loss-tolerance", type=float, default=harm.LOSS_TOLERANCE,
                   help="plain-text loss: HARM when the relative increase's lower bound exceeds this (default: "
                        "%(default)s = 2%%)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="use the chat template for the needle questions (default: when the tokenizer has one)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="evaluate long-context use: QA, needle, loss by position, RULER, compare, "
                                            "guard",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ev.add_subparsers(dest="eval_cmd", metavar="COMMAND", required=True)
    for add in (_add_qa, _add_needle, _add_position_loss, _add_chat_loss, _add_ruler, _add_compare, _add_guard):
        add(sub)


def _add_qa(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qa", help="document QA: EM/F1 (generation) and answer NLL (teacher forcing)")
    common_args(p)
    _qa_args(p, required=True)
    _skip_bad(p, "bad --data records and questions (an answer not found in its document, an empty document, a file "
                 "longdoc cannot read)")
    p.set_defaults(func=_run_task, task="qa")


def _add_needle(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("needle", help="needle in a haystack: accuracy grid (length x depth) and heatmap")
    common_args(p)
    _needle_args(p)
    _skip_bad(p, "--haystack files longdoc cannot read (an image, a scanned PDF without text, an empty document; "
                 "the same flag as `eval qa --skip-bad`)")
    # Small models answer in a sentence that repeats the question: room for it and the whole value.
    p.add_argument("--max-new-tokens", type=cliargs.length, default=32, help="answer length cap (default: %(default)s)")
    p.set_defaults(func=_run_task, task="needle")


def _add_position_loss(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("position-loss", help="mean token loss by position over long documents, curve PNG")
    common_args(p)
    p.add_argument("--data", nargs="+", default=None, dest="pl_data",
                   help="documents: jsonl/json/parquet/csv with text/document/content, or .txt/.md/.pdf/.docx/.html "
                        "files or a folder of them")
    p.add_argument("--domain", default="legal", choices=("legal", "medical"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length", type=cliargs.length, default=None,
                   help="tokens per document (longer ones are cut; default: the shortest document; "
                        "needed to generate documents when --data is not given)")
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--num-docs", type=int, default=4, help="documents to generate when --data is not given")
    p.add_argument("--limit-docs", type=int, default=None, help="first N documents per --data file")
    p.set_defaults(func=_run_task, task="position-loss")


def _add_chat_loss(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat-loss", help="held-out chat loss: mean loss per assistant token of conversations")
    common_args(p)
    p.add_argument("--data", nargs="+", required=True, dest="chat_data",
                   help="conversations: jsonl/json/parquet with messages [{role, content}] or ShareGPT conversations")
    p.add_argument("--length", type=cliargs.length, default=32768,
                   help="row length: longer conversations are cut as `data prepare --task chat` cuts them "
                        "(default: %(default)s)")
    p.add_argument("--loss-on", choices=["assistant", "all"], default="assistant",
                   help="tokens the loss averages (default: %(default)s)")
    p.add_argument("--truncation", choices=["left", "right"], default="left", help="as data prepare (default: left)")
    p.add_argument("--limit-docs", type=int, default=None, help="first N conversations per --data file")
    p.set_defaults(func=_run_task, task="chat-loss")


def _add_ruler(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ruler", help="RULER-style suite: 8 synthetic long-context tasks x lengths, score grid, heatmap")
    common_args(p)
    _ruler_args(p, alone=True)
    _skip_bad(p, "--haystack files longdoc cannot read (an image, a scanned PDF without text, an empty document; "
                 "the same flag as `eval qa --skip-bad`)")
    p.set_defaults(func=_run_task, task="ruler")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="base vs fine-tuned side by side: two run folders, or two models to evaluate")
    p.add_argument("a", help="run folder (or suite folder) or model of the first side (e.g. the base model)")
    p.add_argument("b", help="run folder or model of the second side (e.g. the fine-tuned model)")
    p.add_argument("--names", nargs=2, default=None, metavar=("A", "B"), help="labels (default: base, tuned)")
    p.add_argument("--tasks", default="qa,needle,position-loss",
                   help="tasks to run when A/B are models: qa, needle, position-loss, ruler (default: %(default)s)")
    common_args(p, model=False)
    _qa_args(p, required=False)
    _needle_args(p)
    _position_args(p)
    _ruler_args(p, alone=False)
    _skip_bad(p, "what cannot be used, one flag for both inputs: bad --data records and questions (qa, as `eval qa "
                 "--skip-bad`) and --haystack files longdoc cannot read (needle, ruler; e.g. an image in the folder)")
    cache_args(p)
    p.set_defaults(func=_run_compare, task="compare")


def _add_guard(sub: argparse._SubParsersAction) -> None:
    from longdoc.eval.harm import RULE

    p = sub.add_parser("guard", help="no-harm check before shipping: base vs tuned on your own held-out text; exit 1 "
                                     "on HARM",
                       description="Did fine-tuning harm the base model's retrieval and plain-text behaviour on your "
                                   "own held-out text? Both models run the needle grid planted in --text and the "
                                   "plain-text loss by position (optionally a short RULER-style subset) in one start "
                                   f"of the CP ranks; tuned minus base is paired item by item. {RULE}. Exit status: "
                                   "0 NO HARM, 1 HARM, 2 bad input (one line on stderr). Writes results.json, "
                                   "summary.md, guard.png and base/, tuned/ run folders in --out.")
    _guard_args(p)
    common_args(p, model=False)
    _skip_bad(p, "--text files longdoc cannot read (an image, a scanned PDF without text, an empty document)")
    cache_args(p)
    p.set_defaults(func=_run_guard, task="guard")


def cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the results of a (model, task) evaluated before with the same model files, inputs, "
                        "settings and versions (keyed by content; --no-cache evaluates again) (default: on)")
    p.add_argument("--cache-dir", default=None,
                   help="where cached results live (default: ~/.cache/longdoc/eval, or $XDG_CACHE_HOME/longdoc/eval)")


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The task config shipped to every rank: the parsed arguments as plain data."""
    from longdoc.eval.runner import check_dtype

    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "verb", "eval_cmd")}
    check_dtype(cfg["dtype"])
    if cfg.get("rope_factor") is not None and cfg.get("rope_type") is None:
        raise ValueError("--rope-factor needs --rope-type (linear or yarn), e.g. --rope-type yarn --rope-factor 2")
    if cfg.get("rope_type") is not None and (cfg.get("rope_factor") or 0) <= 1:
        raise ValueError(f"--rope-type {cfg['rope_type']} needs --rope-factor > 1 (e.g. 2: twice the context)")
    if registry.get(cfg.get("strategy", "ring")).factored and not cfg.get("ulysses_size"):
        raise ValueError("--strategy usp needs --ulysses-size U (ranks per Ulysses group, a divisor of --cp)")
    if cfg.get("ulysses_size") is not None and (cfg["ulysses_size"] < 1 or cfg.get("cp", 1) % cfg["ulysses_size"]):
        raise ValueError(f"--ulysses-size must divide --cp {cfg.get('cp', 1)}, got {cfg['ulysses_size']}")
    if isinstance(cfg.get("length"), list):
        cfg["length"] = cfg["length"][0]
    return cfg


def _run_task(args: argparse.Namespace) -> int:
    from longdoc.eval import tasks
    from longdoc.eval.runner import check_model

    cfg = config(args)
    check_model(cfg)
    path = tasks.run_and_report(args.task, cfg)
    if path is not None:
        from longdoc.eval import report
        from longdoc.eval.data import skipped_lines

        results = report.load_results(path)
        print(report.headline(results))
        for line in skipped_lines(results):  # --skip-bad: every item named, as `data prepare` lists them
            print(f"  {line}", file=sys.stderr)
        print(f"report: {path}")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from longdoc.eval import compare

    path = compare.main(config(args))
    if path is not None:
        print(f"report: {path}")
    return 0


def _run_guard(args: argparse.Namespace) -> int:
    from longdoc.eval import guard

    return guard.main(config(args))
