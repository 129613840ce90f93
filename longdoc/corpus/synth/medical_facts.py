"""The facts a simulated patient history plants, each with the span that states it (questions cite the spans)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from longdoc.corpus.synth.sections import Ref


@dataclass
class DoseSet:  # a start, a change or a stop: the dose from `date` on
    date: dt.date
    med: str
    dose: str
    ref: Ref
    change: bool
    stop: bool = False
    date_ref: Ref | None = None  # the dated header of the note that holds it


@dataclass
class Lab:
    date: dt.date
    analyte: str
    text: str  # value as written
    value: float
    flag: str
    ref: Ref
    header: Ref | None = None  # "Collected: <date>" of its report


@dataclass
class Event:  # something with a date that questions can name: an incident, a study, a consult
    date: dt.date
    kind: str  # "incident" | "study" | "consult" | "admission"
    key: str
    name: str
    ref: Ref
    value: str = ""  # the measurement of a study, the consultant of a consult
    value_ref: Ref | None = None
