"""Text helpers of the synthetic generators: the data files, template filling, dates, money, times, names.

Vocabulary and templates live in `data/synth/<domain>/*.json` (domain "common" for shared names); the
formatters write a fact the way a document does, the `*_aliases` give the other ways a correct answer
may be written.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import random
from typing import Any

from longdoc.runtime.resources import resource_dir

DATA_DIR = resource_dir("synth")  # data/synth in a checkout, a bundled copy in a wheel
DATE_STYLES = ("us", "long", "iso")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")


@functools.cache
def load_data(domain: str, name: str) -> dict[str, Any]:
    """`data/synth/<domain>/<name>.json` (domain "common" for shared vocabularies)."""
    path = DATA_DIR / domain / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"synthetic-data file {path} is missing; the generator needs longdoc's data/synth files (a source "
            "checkout and an installed wheel both carry them): reinstall longdoc or restore data/synth"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def fill(template: str, ctx: dict[str, Any]) -> str:
    """`template.format_map(ctx)` with an error naming the missing slot and the template."""
    try:
        return template.format_map(ctx)
    except KeyError as e:
        raise KeyError(f"template slot {e} has no value; template: {template!r}") from None


def fmt_date(d: dt.date, style: str) -> str:
    if style == "us":
        return f"{d.month:02d}/{d.day:02d}/{d.year}"
    if style == "long":
        return f"{_MONTHS[d.month - 1]} {d.day}, {d.year}"
    if style == "iso":
        return d.isoformat()
    raise ValueError(f"date style must be one of {DATE_STYLES}, got {style!r}")


def date_aliases(d: dt.date, style: str) -> list[str]:
    """The same date in the other styles, so a correct answer in another format still matches."""
    return [fmt_date(d, other) for other in DATE_STYLES if other != style]


def fmt_money(cents: int) -> str:
    """12345678 -> '$123,456.78'."""
    return f"${cents // 100:,}.{cents % 100:02d}"


def fmt_dollars(dollars: int) -> str:
    """450000 -> '$450,000'."""
    return f"${dollars:,}"


def money_aliases(text: str) -> list[str]:
    """'$450,000' -> ['450,000', '$450,000.00']; '$1,234.00' -> ['1,234.00', '$1,234']."""
    bare = text.lstrip("$")
    other = text[:-3] if text.endswith(".00") else (text if "." in text else text + ".00")
    return [bare] + ([other] if other != text else [])


def fmt_time(minutes: int) -> str:
    """Minutes after midnight -> '7:45 a.m.'."""
    h, m = divmod(minutes, 60)
    suffix = "a.m." if h < 12 else "p.m."
    return f"{(h - 1) % 12 + 1}:{m:02d} {suffix}"


def number_aliases(n: int) -> list[str]:
    words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
             "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
             "nineteen", "twenty")
    return [words[n]] if 0 <= n < len(words) else []


def person_name(rng: random.Random, common: dict[str, Any], used: set[str] | None = None,
                sex: str | None = None) -> tuple[str, str, str]:
    """(first, last, sex 'F'|'M'). With `used`, the full name is new and, while the pool lasts, so is the
    surname (so "Mr. Lambert" is unambiguous); `used` is only tested for membership."""
    for attempt in range(10_000):
        s = sex or rng.choice(("F", "M"))
        first = rng.choice(common["first_names_female" if s == "F" else "first_names_male"])
        last = rng.choice(common["last_names"])
        if used is None:
            return first, last, s
        if f"{first} {last}" in used or (last in used and attempt < 50):
            continue
        used.update((f"{first} {last}", last))
        return first, last, s
    raise RuntimeError("ran out of distinct person names; add names to data/synth/common/names.json")
