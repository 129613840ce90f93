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
    """ArgumentParser whose choice errors suggest the nearest choice; `add_subparsers` makes sub-parsers of
    the same class, so one instance at the top covers every verb and option."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own hook for `choices`; overriding it covers verbs (sub-commands) and options alike.
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, did_you_mean(value, action.choices))
