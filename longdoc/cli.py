"""`longdoc <verb>`: the command line. Each verb lives in its own module with `add_parser(subparsers)`.

Verb modules keep heavy imports (torch, transformers, datasets) inside their handlers so that
`longdoc --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from longdoc import __version__
from longdoc.cliargs import Parser
from longdoc.errors import EXIT_BUG, EXIT_CODES, EXIT_USAGE, USER_ERRORS

# verb module -> it registers one or more sub-commands on the parser.
VERB_MODULES: list[str] = [
    "longdoc.envinfo",
    "longdoc.plan.cli",
    "longdoc.bench.cli",
    "longdoc.hf.verify",
    "longdoc.train.cli",
    "longdoc.eval.cli",
    "longdoc.corpus.cli",
    "longdoc.ask.cli",
    "longdoc.runtime.resources",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="longdoc",
        description="Exact context-parallel fine-tuning of Hugging Face causal LMs on long documents.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"longdoc {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def one_line(e: BaseException) -> str:
    """A user error's message on one line (messages that quote another library's error may hold newlines)."""
    return " ".join(part.strip() for part in str(e).splitlines() if part.strip()) or type(e).__name__


def verb_of(args: argparse.Namespace) -> str:
    return " ".join(x for x in (args.verb, *(getattr(args, k, None) for k in ("eval_cmd", "data_verb"))) if x)


def main(argv: list[str] | None = None, *, catch: bool | None = None) -> int:
    """Run `longdoc ARGS`. On the command line (argv None) bad input (longdoc.errors.USER_ERRORS, raised here or in
    a spawned rank) exits 2 with its message on one line, and any other exception, a bug, exits 3 after its
    traceback; called with an explicit argv (scripts, tests) the exception propagates unless `catch=True`."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not (argv is None if catch is None else catch):
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"longdoc {verb_of(args)}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - not the user's input: show where it broke, with its own exit status
        traceback.print_exc()
        print(f"longdoc {verb_of(args)}: internal error (a bug, not bad input); please report the traceback above",
              file=sys.stderr)
        return EXIT_BUG
