"""Questions over a simulated patient history (see medical_chart.py): every answer follows from the record.

Families and phrasings are in `data/synth/medical/questions.json`; each family belongs to one kind
(lookup, distractor, multi_hop, count, aggregate, temporal_order, interval, latest).
"""

from __future__ import annotations

import itertools
import random

from longdoc.corpus.synth.medical_chart import PatientChartSimulator
from longdoc.corpus.synth.medical_facts import DoseSet, Event, Lab
from longdoc.corpus.synth.questions import QA, Asker
from longdoc.corpus.synth.sections import Ref
from longdoc.corpus.synth.text import number_aliases

_PER_FAMILY = 3


def _some(rng: random.Random, items: list, k: int = _PER_FAMILY) -> list:
    return rng.sample(items, min(k, len(items)))


def _dose_before(doses: list[DoseSet], med: str, ev: Event) -> DoseSet | None:
    """The dose setting in effect on the event's day; None when it changed on that very day."""
    sets = [d for d in doses if d.med == med]
    if any(d.date == ev.date for d in sets):
        return None
    before = [d for d in sets if d.date < ev.date]
    return before[-1] if before and not before[-1].stop else None


def questions(sim: PatientChartSimulator, ask: Asker, rng: random.Random) -> list[QA]:
    """Every kind's questions over the patient history, kind by kind (the order is part of the seed's output)."""
    labs_by: dict[str, list[Lab]] = {}
    for lab in sim.labs:
        labs_by.setdefault(lab.analyte, []).append(lab)
    by_key: dict[str, list[Event]] = {}
    for e in sim.events:
        by_key.setdefault(f"{e.kind}:{e.key}", []).append(e)
    unique = [evs[0] for evs in by_key.values() if len(evs) == 1]  # events that happen once: a question names them
    named = [e for e in unique if e.kind in ("incident", "study")]
    changed = sorted({x.med for x in sim.doses if x.change})
    return [*_lookups(sim, ask, rng, by_key), *_distractors(sim, ask, rng, labs_by),
            *_multi_hop(sim, ask, rng, named, changed), *_counts(sim, ask, rng, labs_by, changed),
            *_aggregates(sim, ask, rng, labs_by, changed), *_time(sim, ask, rng, unique, named)]


def _lookups(sim: PatientChartSimulator, ask: Asker, rng: random.Random, by_key: dict[str, list[Event]]) -> list[QA]:
    """Facts written once; a study repeated with other values asks for one of them (a distractor)."""
    out: list[QA] = []
    out.append(ask.ask("allergy_reaction", sim.reaction, [Ref(sim.header, "allergy")], agent=sim.allergy["agent"]))
    out.append(ask.ask("mrn", sim.mrn, [Ref(sim.header, "mrn")], patient=sim.p["patient"]))
    blood = sim.header.text[slice(*sim.header.spans["blood"])]
    out.append(ask.ask("blood_type", blood, [Ref(sim.header, "blood")], patient=sim.p["patient"],
                       aliases=[blood.replace(" positive", "+").replace(" negative", "-")]))
    for evs in by_key.values():
        e = evs[0]
        if e.kind == "consult" and len(evs) == 1:
            out.append(ask.ask("consultant", e.value, [e.value_ref], specialty=sim.v["consults"][e.key]["name"]))
        if e.kind == "study" and e.value_ref is not None:
            m = sim.v["imaging"][e.key]["measure"]
            if len(evs) == 1:
                out.append(ask.ask("imaging_measure", e.value, [e.value_ref], label=m["label"], study=e.name[4:],
                                   unit=m["unit"]))
            else:  # the same study repeated with other values: a distractor
                for x in _some(rng, evs, 2):
                    out.append(ask.ask("measure_on_date", x.value, [x.value_ref, x.ref], label=m["label"],
                                       study=x.name[4:], unit=m["unit"], date=sim.d(x.date)))
    return out


def _distractors(sim: PatientChartSimulator, ask: Asker, rng: random.Random, labs_by: dict[str, list[Lab]]) -> list[QA]:
    """One lab value among many of the same analyte."""
    out: list[QA] = []
    spec = sim.v["labs"]
    for analyte in sorted(labs_by):
        labs = labs_by[analyte]
        if len(labs) >= 3 and len({lab.text for lab in labs}) >= 2:
            for lab in _some(rng, labs, 1):
                out.append(ask.ask("lab_on_date", lab.text, [lab.ref, lab.header], analyte=spec[analyte]["q"],
                                   unit=spec[analyte]["unit"], date=sim.d(lab.date)))
    return out


def _multi_hop(sim: PatientChartSimulator, ask: Asker, rng: random.Random, named: list[Event],
               changed: list[str]) -> list[QA]:
    """A dose or lab on the day of a named event elsewhere in the record."""
    out: list[QA] = []
    for e, med in _some(rng, list(itertools.product(named, changed)), 6):
        dose = _dose_before(sim.doses, med, e)
        if dose is not None:
            family, slots = ("dose_on_event", {"event": e.name}) if e.kind == "incident" else \
                ("dose_on_study", {"study": e.name[4:]})
            out.append(ask.ask(family, dose.dose, [dose.ref, dose.date_ref, e.ref], med=med, **slots))
    spec = sim.v["labs"]
    for e in (e for e in named if e.kind == "incident"):
        same_day = [lab for lab in sim.labs if lab.date == e.date]
        for lab in _some(rng, same_day, 1):
            out.append(ask.ask("lab_on_event", lab.text, [lab.ref, lab.header, e.ref], event=e.name,
                               analyte=spec[lab.analyte]["q"], unit=spec[lab.analyte]["unit"]))
    return out


def _counts(sim: PatientChartSimulator, ask: Asker, rng: random.Random, labs_by: dict[str, list[Lab]],
            changed: list[str]) -> list[QA]:
    out: list[QA] = []
    for med in changed:
        refs = [x.ref for x in sim.doses if x.med == med and x.change]
        if len(refs) >= 2:
            out.append(ask.ask("dose_changes", str(len(refs)), refs, number_aliases(len(refs)), med=med))
    admissions = [e.ref for e in sim.events if e.kind == "admission"]
    out.append(ask.ask("admissions", str(len(admissions)), admissions, number_aliases(len(admissions))))
    studies = [e.ref for e in sim.events if e.kind == "study"]
    if studies:
        out.append(ask.ask("imaging_count", str(len(studies)), studies, number_aliases(len(studies))))
    spec = sim.v["labs"]
    for analyte in _some(rng, sorted(labs_by), 4):
        for flag, word in (("H", "high"), ("L", "low")):
            refs = [lab.ref for lab in labs_by[analyte] if lab.flag == flag]
            if refs:
                out.append(ask.ask("flagged_results", str(len(refs)), refs, number_aliases(len(refs)),
                                   analyte=spec[analyte]["q"], flag=flag, flag_word=word))
    return out


def _aggregates(sim: PatientChartSimulator, ask: Asker, rng: random.Random, labs_by: dict[str, list[Lab]],
                changed: list[str]) -> list[QA]:
    """A lab's highest, lowest and latest value; a medication's latest dose."""
    out: list[QA] = []
    spec = sim.v["labs"]
    for analyte in _some(rng, [a for a in sorted(labs_by) if len(labs_by[a]) >= 3], 4):
        labs, s = labs_by[analyte], spec[analyte]
        hi, lo = max(labs, key=lambda x: x.value), min(labs, key=lambda x: x.value)
        slots = {"analyte": s["q"], "unit": s["unit"]}
        out.append(ask.ask("lab_max", hi.text, [hi.ref], **slots))
        out.append(ask.ask("lab_min", lo.text, [lo.ref], **slots))
        out.append(ask.ask("latest_lab", labs[-1].text, [labs[-1].ref], **slots))
    for med in (m for m in changed if m in sim.meds):
        last = [x for x in sim.doses if x.med == med][-1]
        out.append(ask.ask("latest_dose", last.dose, [Ref(sim.final, f"med:{med}"), last.ref], med=med))
    return out


def _time(sim: PatientChartSimulator, ask: Asker, rng: random.Random, unique: list[Event],
          named: list[Event]) -> list[QA]:
    """Order and intervals between named events and medication starts."""
    out: list[QA] = []
    pairs = [(a, b) for a, b in itertools.combinations([e for e in unique if e.kind != "admission"], 2)
             if a.date != b.date and a.name != b.name]
    for a, b in _some(rng, pairs, 4):
        first, second = (a, b) if a.date < b.date else (b, a)
        x, y = (a, b) if rng.random() < 0.5 else (b, a)
        out.append(ask.ask("event_order", first.name, [a.ref, b.ref], [first.name.removeprefix("the ")],
                           a=x.name, b=y.name))
        days = (second.date - first.date).days
        out.append(ask.ask("days_between", str(days), [first.ref, second.ref], number_aliases(days),
                           a=first.name, b=second.name))
    admits = [e for e in sim.events if e.kind == "admission"]
    for e in (e for e in named if e.kind == "incident"):
        adm = [a for a in admits if a.date <= e.date][-1]
        days = (e.date - adm.date).days
        out.append(ask.ask("days_admit_to_event", str(days), [adm.ref, e.ref], number_aliases(days),
                           event=e.name, date=sim.d(adm.date)))
    starts = {}
    for x in sim.doses:
        starts.setdefault(x.med, x)
    start_pairs = [(a, b) for a, b in itertools.combinations(starts.values(), 2) if a.date != b.date]
    for a, b in _some(rng, start_pairs, 2):
        first = a if a.date < b.date else b
        out.append(ask.ask("med_start_order", first.med, [a.ref, a.date_ref, b.ref, b.date_ref], a=a.med, b=b.med))
    return out
