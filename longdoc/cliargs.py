"""Argument types and the parser every `longdoc` command line shares: token counts with k/M suffixes and a
"did you mean" for mistyped choices, so `--seq-len 128k` and `--domain legl` behave alike in every verb.

    p.add_argument("--seq-len", type=cliargs.length)          # 4096, 4k, 1.5k, 128K, 1M
    p.add_argument("--lengths", type=cliargs.lengths)         # 1k,2k,4096
    parser = cliargs.Parser(prog="longdoc")                   # sub-commands inherit the class
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import Any

# Context lengths are powers of two in practice (8k = 8192 positions), so k and M are binary here.
_UNITS = {"k": 1024, "m": 1024 * 1024}


def length(text: str) -> int:
    """A positive token count: '4096', '4k' (4096), '1.5k' (1536), '128K', '1M' (1048576)."""
    t = str(text).strip()
    unit = _UNITS.get(t[-1:].lower(), 1)
    number = t[:-1] if unit > 1 else t
    try:
        value = float(number) * unit
    except ValueError:
        value = float("nan")
    if not (1 <= value < float("inf") and value == int(value)):
        raise argparse.ArgumentTypeError(f"expected a positive token count such as 4096, 4k, 128k or 1M "
                                         f"(k = 1024, M = 1048576), got {text!r}")
    return int(value)


def lengths(text: str) -> list[int]:
    """Comma-separated token counts: '1k,2k,4096' -> [1024, 2048, 4096]."""
    items = [x for x in (s.strip() for s in str(text).split(",")) if x]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts (e.g. 1k,2k,4k), got {text!r}")
    return [length(x) for x in items]


def did_you_mean(value: Any, choices: Iterable[Any]) -> str:
    """'invalid choice' message listing the choices, with the closest one first when there is one."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"invalid choice: {value!r} (choose from {', '.join(names)}){hint}"


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose choice errors suggest the nearest choice and whose options may come anywhere among
    the positionals; `add_subparsers` makes sub-parsers of the same class, so one instance at the top covers
    every verb and option."""

    def parse_known_args(self, args=None, namespace=None):
        # `longdoc train r.yaml --nproc 2 train.steps=1`: plain argparse fills a list positional (the key=value
        # overrides, `data prepare` inputs, `bench` sections) from the first run of positionals only and calls the
        # rest unrecognized. A verb's own parser (no sub-commands below it) parses intermixed, as
        # parse_intermixed_args does; argparse calls parse_known_args again from inside it, hence the flag.
        if getattr(self, "_intermixing", False) or not _can_intermix(self):
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own hook for `choices`; overriding it covers verbs (sub-commands) and options alike.
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, did_you_mean(value, action.choices))


def _can_intermix(parser: argparse.ArgumentParser) -> bool:
    """Whether argparse's intermixed parsing applies: positionals, none of them sub-commands or a remainder, and
    none in a mutually exclusive group (parse_intermixed_args refuses those)."""
    positionals = [a for a in parser._actions if not a.option_strings]
    grouped = {id(a) for g in parser._mutually_exclusive_groups for a in g._group_actions}
    return bool(positionals) and all(a.nargs not in (argparse.PARSER, argparse.REMAINDER) and id(a) not in grouped
                                     for a in positionals)
