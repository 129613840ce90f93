"""The facts a simulated case file plants, each with the span that states it (questions cite the spans)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from longdoc.corpus.synth.sections import Ref


@dataclass
class Dated:  # a dated fact with its span: a trial setting, a demand, an offer, a filing
    date: dt.date
    text: str
    ref: Ref
    value: int = 0
    date_ref: Ref | None = None  # the dated line of the paper that holds it


@dataclass
class TrialSetting:
    set_on: dt.date
    trial: dt.date
    text: str
    ref: Ref
    ordered: Ref  # "SO ORDERED on <date>" of the order that set it


@dataclass
class Deposition:
    date: dt.date
    witness: str
    sex: str
    employer: str
    head: Ref
    date_ref: Ref
    arrival: Dated | None = None
    tenure: Dated | None = None
    shown: list[tuple[int, Ref]] = field(default_factory=list)
    is_plaintiff: bool = False


@dataclass
class Invoice:
    number: str
    number_ref: Ref
    vendor: str
    total: Dated
    exhibit: int


@dataclass
class Motion:
    side: str  # "plaintiff" | "defendant"
    key: str
    name: str  # "defendant's motion to compel"
    filed: Dated
    ruled: bool = False

