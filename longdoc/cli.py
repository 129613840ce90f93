"""`longdoc <verb>`: the command line. Each verb lives in its own module with `add_parser(subparsers)`.

Verb modules keep heavy imports (torch, transformers, datasets) inside their handlers so that
`longdoc --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from longdoc.cliargs import Parser

# verb module -> it registers one or more sub-commands on the parser.
VERB_MODULES: list[str] = [
    "longdoc.envinfo",
    "longdoc.plan.cli",
    "longdoc.bench.cli",
    "longdoc.hf.verify",
    "longdoc.train.cli",
    "longdoc.eval.cli",
    "longdoc.corpus.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="longdoc",
        description="Exact context-parallel fine-tuning of Hugging Face causal LMs on long documents.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def _input_errors() -> tuple[type[BaseException], ...]:
    # Bad input (a recipe key, a file, a record, a length): every one of these carries a message that
    # names the problem and the fix, so the user sees that message and never a traceback.
    from longdoc.train.checkpoint import CheckpointError

    return (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, CheckpointError)


def main(argv: list[str] | None = None, *, catch: bool | None = None) -> int:
    """Run `longdoc ARGS`. On the command line (argv None) bad input exits 2 with its message; called with an
    explicit argv (scripts, tests) the exception propagates unless `catch=True`."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not (argv is None if catch is None else catch):
        return int(args.func(args) or 0)
    try:
        return int(args.func(args) or 0)
    except _input_errors() as e:
        verb = " ".join(x for x in (args.verb, *(getattr(args, k, None) for k in ("eval_cmd", "data_verb"))) if x)
        print(f"longdoc {verb}: error: {e}", file=sys.stderr)
        return 2
