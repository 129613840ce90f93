"""The state of a simulated patient chart, declared once, and the helpers every kind of note uses.

`medical_chart.PatientChartSimulator` sets these attributes when the chart starts and updates them day
by day; `medical_diagnostics.DiagnosticReports` reads and extends them. They are declared here, never
given class-level values (the engine undoes a section by restoring the instance attributes, and `cond`
is absent until the first admission), so that each part says what state it relies on.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable
from typing import Any

from longdoc.corpus.synth.medical_facts import DoseSet, Event, Lab
from longdoc.corpus.synth.sections import Section
from longdoc.corpus.synth.text import fmt_date, person_name


class ChartState:
    domain = "medical"

    rng: random.Random
    seed_key: str
    v: dict[str, Any]  # data/synth/medical/vocab.json
    t: dict[str, Any]  # data/synth/medical/templates.json
    common: dict[str, Any]  # data/synth/common/names.json
    used_names: set[str]  # full names and surnames taken (text.person_name keeps them distinct)
    style: str  # the date style of the whole chart (text.DATE_STYLES)
    p: dict[str, Any]  # the patient's template slots: name, pronouns, age, relation
    sex: str  # "F" | "M"
    hospital: str
    pmh: list[str]  # past medical history
    conditions: list[dict[str, Any]]  # conditions still to be admitted for (the first one's history fits)
    cond: dict[str, Any]  # the condition of the current or last admission (absent before the first)
    allergy: dict[str, Any]
    reaction: str
    mrn: str
    pcp: str  # primary care physician
    date: dt.date  # the date of the note being written
    meds: dict[str, int]  # active medication -> index of its current dose
    doses: list[DoseSet]  # every start, change and stop
    labs: list[Lab]
    lab_state: dict[str, float]  # analyte -> last value (labs drift from it)
    events: list[Event]  # admissions, incidents, studies, consults
    queue: list[Callable[[], Section]]  # notes due before the simulation moves on
    in_hospital: bool
    day: int  # hospital day
    los: int  # planned length of stay
    attending: str
    service: str
    pending: list[str]  # planted events that came due and wait for their note
    tracked: list[str]  # medications whose dose changes the questions follow
    n_visits: int  # admissions so far
    compact: bool  # a short chart (under 6k tokens): fewer panels and history lines, more events
    plot: list[tuple[float, str]]  # (depth, what): planted events still to come, by depth
    incident_keys: list[str]  # incident kinds in the order this chart uses them
    header: Section  # the chart summary (opening)
    final: Section  # the active medication list (closing)

    def doctor(self) -> str:
        first, last, _ = person_name(self.rng, self.common, self.used_names)
        return f"{first} {last}"

    def d(self, date: dt.date | None = None) -> str:
        return fmt_date(date or self.date, self.style)
