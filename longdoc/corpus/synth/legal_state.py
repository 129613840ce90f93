"""The state of a simulated case file, declared once, and the helpers every kind of paper uses.

`legal_case.LegalCaseSimulator` sets these attributes when a case starts and updates them paper by
paper; `legal_discovery.DiscoveryPapers` reads and extends them. They are declared here, never given
class-level values (the engine undoes a section by restoring the instance attributes), so that each
part says what state it relies on.
"""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from longdoc.corpus.synth.legal_facts import Dated, Deposition, Invoice, Motion, TrialSetting
from longdoc.corpus.synth.text import fmt_date


class CaseState:
    domain = "legal"

    rng: random.Random
    seed_key: str
    v: dict[str, Any]  # data/synth/legal/vocab.json
    common: dict[str, Any]  # data/synth/common/names.json
    used: set[str]  # full names and surnames taken (text.person_name keeps them distinct)
    style: str  # the date style of the whole file (text.DATE_STYLES)
    ckey: str  # the case type's key in v["case_types"]
    ct: dict[str, Any]  # the case type: facts, causes, roles, vendors, witness questions
    city: str
    state: str  # the US state the court sits in
    court: str
    judge: str
    plaintiff: str
    p_short: str  # "Ms. Lambert", or a company's short name
    p_sex: str  # "F" | "M"; "" when the plaintiff is a company
    defendant: str
    d_short: str
    counsel: dict[str, dict[str, str]]  # side -> name, last, title, firm
    incident: dt.date
    agreement_date: dt.date
    address: str
    place: str  # where the incident happened
    date: dt.date  # the date of the paper being written
    case_no: str
    damages: int  # dollars sought in the complaint
    trial: list[TrialSetting]  # every trial setting, the one in effect last
    demands: list[Dated]
    offers: list[Dated]
    depositions: list[Deposition]
    invoices: list[Invoice]
    motions: list[Motion]
    exhibits: int  # exhibits marked so far
    facts: dict[str, Dated]  # single facts of the pleadings: filed, incident, damages, answer
    compact: bool  # a short file (under 6k tokens): shorter pleadings and transcripts
    plot: list[tuple[float, str]]  # (depth, what): planted events still to come, by depth
    pending: list[str]  # events that came due and wait for their paper

    def d(self, date: dt.date | None = None) -> str:
        return fmt_date(date or self.date, self.style)

    def party(self, side: str) -> str:
        return self.plaintiff if side == "plaintiff" else self.defendant

    def advance(self, lo: int = 2, hi: int = 25) -> None:
        self.date += dt.timedelta(days=self.rng.randint(lo, hi))
