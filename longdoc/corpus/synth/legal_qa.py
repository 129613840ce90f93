"""Questions over a simulated case file (see legal_case.py): every answer follows from the file.

Families and phrasings are in `data/synth/legal/questions.json`; each family belongs to one kind
(lookup, distractor, multi_hop, count, aggregate, temporal_order, interval, latest).
"""

from __future__ import annotations

import itertools
import random

from longdoc.corpus.synth.legal_case import LegalCaseSimulator
from longdoc.corpus.synth.questions import QA, Asker
from longdoc.corpus.synth.sections import Ref
from longdoc.corpus.synth.text import date_aliases, money_aliases, number_aliases


def _some(rng: random.Random, items: list, k: int = 3) -> list:
    return rng.sample(items, min(k, len(items)))


def _before(items: list, date) -> object | None:
    """The last dated item strictly before `date`; None if one falls on that very day (ambiguous)."""
    if any(getattr(x, "set_on", getattr(x, "date", None)) == date for x in items):
        return None
    prior = [x for x in items if getattr(x, "set_on", getattr(x, "date", None)) < date]
    return prior[-1] if prior else None


_PRONOUNS = {"F": ("she", "her"), "M": ("he", "his")}


def questions(sim: LegalCaseSimulator, ask: Asker, rng: random.Random) -> list[QA]:
    """Every kind's questions over the case file, kind by kind (the order is part of the seed's output)."""
    return [*_lookups(sim, ask), *_distractors(sim, ask, rng), *_multi_hop(sim, ask, rng), *_counts(sim, ask),
            *_aggregates(sim, ask), *_time(sim, ask, rng)]


def _unique_motions(sim: LegalCaseSimulator) -> list:
    """The motions whose name no other motion of the file shares (a question can name them)."""
    names = [m.name for m in sim.motions]
    return [m for m in sim.motions if names.count(m.name) == 1]


def _lookups(sim: LegalCaseSimulator, ask: Asker) -> list[QA]:
    out: list[QA] = []
    f = sim.facts
    parties = {"plaintiff": sim.plaintiff, "defendant": sim.defendant}
    complaint = f["filed"].ref.section
    out.append(ask.ask("case_number", sim.case_no, [Ref(complaint, "case_no")], **parties))
    out.append(ask.ask("judge", sim.judge, [Ref(complaint, "judge")], [sim.judge.removeprefix("Hon. ")], **parties))
    out.append(ask.ask("damages_sought", f["damages"].text, [f["damages"].ref], money_aliases(f["damages"].text)))
    if "incident" in f:
        out.append(ask.ask("incident_date", f["incident"].text, [f["incident"].ref],
                           date_aliases(sim.incident, sim.style), incident=sim.ct["incident"]))
    for side, key in (("plaintiff", "filed"), ("defendant", "answer")):
        if key in f:
            out.append(ask.ask("firm", sim.counsel[side]["firm"], [Ref(f[key].ref.section, f"firm_{side}")], side=side))
    return out


def _distractors(sim: LegalCaseSimulator, ask: Asker, rng: random.Random) -> list[QA]:
    """One of several facts of the same kind."""
    out: list[QA] = []
    if len(sim.invoices) >= 2:
        for inv in _some(rng, sim.invoices, 2):
            out.append(ask.ask("invoice_amount", inv.total.text, [inv.total.ref, inv.number_ref],
                               money_aliases(inv.total.text), number=inv.number, vendor=inv.vendor))
    deps = sim.depositions
    if len({x.date for x in deps}) >= 2:
        for dep in _some(rng, deps, 2):
            out.append(ask.ask("deposition_date", sim.d(dep.date), [dep.date_ref], date_aliases(dep.date, sim.style),
                               witness=dep.witness))
    with_arrival = [x for x in deps if x.arrival]
    if len(with_arrival) >= 2:
        for dep in _some(rng, with_arrival, 2):
            he, his = _PRONOUNS[dep.sex]
            out.append(ask.ask("arrival_time", dep.arrival.text, [dep.arrival.ref, dep.head], witness=dep.witness,
                               he_she=he, his_her=his, place=sim.place, incident=sim.ct["incident"]))
    if len(deps) >= 2:
        for dep in _some(rng, [x for x in deps if x.tenure], 2):
            out.append(ask.ask("tenure", dep.tenure.text, [dep.tenure.ref, dep.head], witness=dep.witness,
                               employer=dep.employer, his_her=_PRONOUNS[dep.sex][1]))
    return out


def _multi_hop(sim: LegalCaseSimulator, ask: Asker, rng: random.Random) -> list[QA]:
    """A fact in effect on the date of another: the trial setting when a motion was filed, the demand standing at a
    deposition, the invoice shown to a witness."""
    out: list[QA] = []
    deps = sim.depositions
    if len(sim.trial) >= 2:
        for m in _some(rng, _unique_motions(sim), 3):
            setting = _before(sim.trial, m.filed.date)
            if setting is not None:
                movant = f"the {m.side}"
                out.append(ask.ask("trial_at_motion", setting.text, [setting.ref, setting.ordered, m.filed.ref],
                                   date_aliases(setting.trial, sim.style), movant=movant,
                                   motion=m.name.split("'s ", 1)[1]))
    for dep in _some(rng, deps, 3):
        demand = _before(sim.demands, dep.date)
        if demand is not None:
            out.append(ask.ask("demand_at_deposition", demand.text, [demand.ref, demand.date_ref, dep.date_ref],
                               money_aliases(demand.text), witness=dep.witness))
    by_exhibit = {inv.exhibit: inv for inv in sim.invoices}
    for dep in deps:
        for num, ref in dep.shown[:1]:
            inv = by_exhibit[num]
            out.append(ask.ask("shown_invoice", inv.total.text, [ref, inv.total.ref], money_aliases(inv.total.text),
                               witness=dep.witness, his_her=_PRONOUNS[dep.sex][1]))
    return out


def _counts(sim: LegalCaseSimulator, ask: Asker) -> list[QA]:
    out: list[QA] = []
    deps = sim.depositions
    out.append(ask.ask("depositions_count", str(len(deps)), [x.head for x in deps], number_aliases(len(deps))))
    for side in ("plaintiff", "defendant"):
        refs = [m.filed.ref for m in sim.motions if m.side == side]
        if refs:
            out.append(ask.ask("motions_count", str(len(refs)), refs, number_aliases(len(refs)), side=side))
    if len(sim.trial) >= 2:
        refs = [t.ref for t in sim.trial[1:]]
        out.append(ask.ask("continuances", str(len(refs)), refs, number_aliases(len(refs))))
    if sim.invoices:
        refs = [inv.total.ref for inv in sim.invoices]
        out.append(ask.ask("invoices_count", str(len(refs)), refs, number_aliases(len(refs))))
    return out


def _aggregates(sim: LegalCaseSimulator, ask: Asker) -> list[QA]:
    """The largest of several amounts, and the latest of several settings or offers."""
    out: list[QA] = []
    for family, items in (("max_demand", sim.demands), ("max_offer", sim.offers),
                          ("max_invoice", [inv.total for inv in sim.invoices])):
        if len(items) >= 2:
            top = max(items, key=lambda x: x.value)
            out.append(ask.ask(family, top.text, [top.ref], money_aliases(top.text)))
    if sim.trial:
        last = sim.trial[-1]
        out.append(ask.ask("current_trial", last.text, [last.ref, last.ordered], date_aliases(last.trial, sim.style)))
    for family, items in (("last_offer", sim.offers), ("last_demand", sim.demands)):
        if len(items) >= 2:
            last = items[-1]
            out.append(ask.ask(family, last.text, [last.ref, last.date_ref], money_aliases(last.text)))
    return out


def _time(sim: LegalCaseSimulator, ask: Asker, rng: random.Random) -> list[QA]:
    """Which came first, and the days between two dated papers."""
    out: list[QA] = []
    f = sim.facts
    pairs = [(a, b) for a, b in itertools.combinations(sim.depositions, 2) if a.date != b.date]
    for a, b in _some(rng, pairs, 3):
        early, late = (a, b) if a.date < b.date else (b, a)
        out.append(ask.ask("deposed_first", early.witness, [a.date_ref, b.date_ref], a=a.witness, b=b.witness))
        days = (late.date - early.date).days
        out.append(ask.ask("days_between_depositions", str(days), [early.date_ref, late.date_ref],
                           number_aliases(days), a=early.witness, b=late.witness))
    mpairs = [(a, b) for a, b in itertools.combinations(_unique_motions(sim), 2) if a.filed.date != b.filed.date]
    for a, b in _some(rng, mpairs, 2):
        early = a if a.filed.date < b.filed.date else b
        out.append(ask.ask("filed_first", early.name, [a.filed.ref, b.filed.ref], a=a.name, b=b.name))
    if "answer" in f:
        days = (f["answer"].date - f["filed"].date).days
        out.append(ask.ask("days_complaint_answer", str(days), [f["filed"].ref, f["answer"].ref], number_aliases(days)))
    if "incident" in f:
        days = (f["filed"].date - sim.incident).days
        out.append(ask.ask("days_incident_complaint", str(days), [f["incident"].ref, f["filed"].ref],
                           number_aliases(days), incident=sim.ct["incident"]))
    return out
