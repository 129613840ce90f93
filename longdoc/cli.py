"""`longdoc <verb>`: the command line. Each verb lives in its own module with `add_parser(subparsers)`.

Verb modules keep heavy imports (torch, transformers, datasets) inside their handlers so that
`longdoc --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    parser = argparse.ArgumentParser(
        prog="longdoc",
        description="Exact context-parallel fine-tuning of Hugging Face causal LMs on long documents.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in VERB_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)
