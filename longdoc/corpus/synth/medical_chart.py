"""Synthetic patient histories: the simulator, with the admissions, notes, medications and discharges it writes.

The chart is simulated day by day so every planted fact is consistent with the rest of the record
(a dose in effect, the labs of a given day, the order of events). The state is declared in
`medical_state.py`, the planted facts in `medical_facts.py`, the laboratory and imaging reports in
`medical_diagnostics.py`. Vocabulary and text live in `data/synth/medical/*.json`; questions are built
by `medical_qa.py`.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable

from longdoc.corpus.synth.medical_diagnostics import DiagnosticReports
from longdoc.corpus.synth.medical_facts import DoseSet, Event
from longdoc.corpus.synth.sections import Ref, Section
from longdoc.corpus.synth.text import DATE_STYLES, fill, load_data, person_name


class PatientChartSimulator(DiagnosticReports):
    """A `simulator.Simulator` of one patient's record (state: `medical_state.ChartState`)."""

    def __init__(self, rng: random.Random, target: int, seed_key: str):
        self.rng, self.seed_key = rng, seed_key
        self.v, self.t = load_data("medical", "vocab"), load_data("medical", "templates")
        common = load_data("common", "names")
        self.common, self.used_names = common, set()
        self.style = rng.choice(DATE_STYLES)
        first, last, sex = person_name(rng, common, self.used_names)
        self.p = {"patient": f"{first} {last}", "sex_word": "woman" if sex == "F" else "man",
                  "he_she": "she" if sex == "F" else "he", "He_she": "She" if sex == "F" else "He",
                  "his_her": "her" if sex == "F" else "his", "His_her": "Her" if sex == "F" else "His",
                  "age": rng.randint(38, 91), "relation": rng.choice(self.v["relations"])}
        self.sex = sex
        self.hospital = rng.choice(self.v["hospitals"])
        first = rng.choice(self.v["conditions"])  # the history fits the first admission's condition
        self.pmh = first["pmh"] + [x for x in rng.sample(self.v["pmh"], rng.randint(3, 6)) if x not in first["pmh"]]
        self.conditions = [first]
        self.allergy = rng.choice(self.v["allergens"])
        self.reaction = rng.choice(self.allergy["reactions"])
        self.mrn = f"{rng.randint(0, 99_999_999):08d}"
        self.pcp = self.doctor()
        self.date = dt.date(rng.randint(2014, 2023), rng.randint(1, 12), rng.randint(1, 28))
        self.meds = {}
        self.doses = []
        self.labs = []
        self.lab_state = {}
        self.events = []
        self.queue = []
        self.in_hospital, self.day, self.los = False, 0, 0
        self.attending = self.service = ""
        self.pending = []
        self.tracked = []
        self.n_visits = 0
        scale = target / 32768
        self.compact = target < 6000  # short records: fewer panels and history lines, more events
        plot = (["med_change"] * min(24, max(3, round(7 * scale)))
                + ["incident"] * min(6, max(1, round(2 * scale) + 1))
                + ["study"] * min(12, max(2, round(3 * scale) + 1))
                + ["consult"] * min(6, max(1, round(1.5 * scale) + 1)))
        self.plot = sorted((rng.uniform(0.04, 0.9), what) for what in plot)
        self.incident_keys = rng.sample(sorted(self.v["incidents"]), len(self.v["incidents"]))

    # ------------------------------------------------------------------ helpers
    def title(self) -> str:
        return f"Patient health record of {self.p['patient']}, {self.hospital}"

    def ctx(self, **extra) -> dict:
        return {**self.p, "pmh": ", ".join(self.pmh[:-1]) + " and " + self.pmh[-1],
                "days": self.rng.randint(2, 7), "pcp": self.pcp, **extra}

    def med_line(self, med: str) -> str:
        m = self.v["medications"][med]
        return f"{med.capitalize()} {m['doses'][self.meds[med]]} {m['route']} {m['freq']}"

    def set_dose(self, sec: Section, med: str, idx: int, text: str, change: bool) -> None:
        ref = sec.mark(f"dose:{med}:{len(self.doses)}", text, "\n")
        self.meds[med] = idx
        self.doses.append(DoseSet(self.date, med, self.v["medications"][med]["doses"][idx], ref, change,
                                  date_ref=Ref(sec, "date")))

    def start_med(self, sec: Section, med: str) -> None:
        m = self.v["medications"][med]
        idx = self.rng.randrange(min(2, len(m["doses"])))
        text = fill(self.rng.choice(self.t["med_start"]),
                    {"med": med, "dose": m["doses"][idx], **m})
        self.set_dose(sec, med, idx, "- " + text, change=False)

    def change_med(self, sec: Section, med: str) -> None:
        m = self.v["medications"][med]
        old = self.meds[med]
        up = old == 0 or (old < len(m["doses"]) - 1 and self.rng.random() < 0.6)
        new = old + 1 if up else old - 1
        reason = fill(self.rng.choice(self.t["reasons_up"]), m)
        text = fill(self.rng.choice(self.t["med_up" if up else "med_down"]),
                    {"med": med, "Med": med.capitalize(), "old": m["doses"][old], "new": m["doses"][new],
                     "reason": reason, "reason_down": self.rng.choice(self.t["reasons_down"]), **m})
        self.set_dose(sec, med, new, "- " + text, change=True)

    def changeable(self) -> list[str]:
        return [m for m in self.meds if len(self.v["medications"][m]["doses"]) >= 2]

    def vitals(self) -> str:
        r = self.rng
        return (f"T {r.uniform(36.3, 38.4):.1f} C, HR {r.randint(58, 112)}, BP {r.randint(96, 168)}/"
                f"{r.randint(52, 96)} mmHg, RR {r.randint(12, 24)}, SpO2 {r.randint(89, 99)}% on "
                f"{r.choice(self.t['oxygen'])}.")

    # ------------------------------------------------------------------ sections
    def opening(self) -> list[Section]:
        s = self.header = Section("chart_summary", self.date)
        s.line(self.hospital.upper()).line("PATIENT HEALTH RECORD - CONFIDENTIAL").line()
        s.line(f"Patient: {self.p['patient']}")
        s.add("Medical record number: ").mark("mrn", self.mrn, "\n")
        dob = self.date.replace(year=self.date.year - self.p["age"], day=min(self.date.day, 28))
        s.line(f"Date of birth: {self.d(dob)}    Sex: {'Female' if self.sex == 'F' else 'Male'}")
        s.line(f"Primary care physician: Dr. {self.pcp}")
        s.line(f"Insurance: {self.rng.choice(self.v['insurers'])}")
        s.add("Blood type: ").mark("blood", self.rng.choice(self.v["blood_types"]), "\n")
        s.line(f"Code status: {self.rng.choice(self.v['code_status'])}")
        first, last, _ = person_name(self.rng, self.common, self.used_names,
                                     self.v["relation_sex"][self.p["relation"]])
        contact = f"{first} {last}"
        s.line(f"Emergency contact: {contact} ({self.p['relation']}), ({self.rng.randint(201, 989)}) "
               f"555-{self.rng.randint(1000, 9999)}")
        s.add("Allergies: ").mark("allergy", f"{self.allergy['agent']} ({self.reaction})", "\n")
        s.line("Past medical history: " + "; ".join(self.pmh) + ".")
        s.line("Past surgical history: " + "; ".join(self.rng.sample(self.v["psh"], 2)) + ".")
        return [s]

    def next(self, progress: float) -> Section:
        while self.plot and self.plot[0][0] <= progress:
            self.pending.append(self.plot.pop(0)[1])
        if self.queue:
            return self.queue.pop(0)()
        if not self.in_hospital:
            needs_bed = any(p in ("incident", "consult") for p in self.pending)
            if self.n_visits == 0 or needs_bed or self.rng.random() < 0.3:
                return self.admit()
            if "study" in self.pending and self.rng.random() < 0.5:
                self.pending.remove("study")
                return self.study()
            return self.clinic()
        if self.day >= self.los and not any(p in ("incident", "consult") for p in self.pending):
            return self.discharge()
        self.date += dt.timedelta(days=1)
        self.day += 1
        self.queue = [self.progress_note]
        if self.rng.random() < 0.85:
            self.queue.append(self.lab_report)
        extras: list[Callable[[], Section]] = []
        for what, fn in (("incident", self.incident), ("study", self.study), ("consult", self.consult)):
            if what in self.pending:
                self.pending.remove(what)
                extras.append(fn)
        if self.rng.random() < 0.15:
            extras.append(self.procedure)
        self.queue += extras
        return self.queue.pop(0)()

    def admit(self) -> Section:
        self.date += dt.timedelta(days=self.rng.randint(9, 75) if self.n_visits else 0)
        self.in_hospital, self.day, self.los = True, 0, self.rng.randint(3, 9)
        self.n_visits += 1
        fits = [c for c in self.v["conditions"] if set(c["pmh"]) <= set(self.pmh)]
        self.cond = self.conditions.pop() if self.conditions else self.rng.choice(fits)
        self.attending, self.service = self.doctor(), self.rng.choice(self.v["services"])
        s = Section("admission", self.date)
        ctx = self.ctx()
        ref = s.mark("date", f"HISTORY AND PHYSICAL - ADMISSION {self.n_visits}\n{self.hospital}, "
                     f"{self.rng.choice(self.v['units'])}\nDate of admission: {self.d()}",
                     f"    Attending: Dr. {self.attending} ({self.service})\n")
        s.line(f"Chief complaint: {self.rng.choice(self.cond['chief_complaint'])}.").line()
        s.line("History of present illness: " + fill(self.rng.choice(self.cond["hpi"]), ctx)).line()
        new = [m for pmh in self.pmh for m in self.v["home_meds_by_pmh"].get(pmh, []) if m not in self.meds]
        s.line("Home medications:")
        for med in list(self.meds) + [m for i, m in enumerate(new) if m not in new[:i]]:
            if med in self.meds:
                s.line("- " + self.med_line(med))
            else:
                idx = self.rng.randrange(min(3, len(self.v["medications"][med]["doses"])))
                self.meds[med] = idx
                self.set_dose(s, med, idx, "- " + self.med_line(med), change=False)
        s.line(f"Allergies: {self.allergy['agent']} ({self.reaction}).")
        if not self.compact:
            s.line("Social history: " + fill(self.rng.choice(self.v["social"]), {
            "relation": self.p["relation"], "packs": self.rng.randint(10, 50),
                "quit": self.rng.randint(2, 30), "job": self.rng.choice(self.v["jobs"])}))
            s.line("Family history: " + self.rng.choice(self.v["family"]))
            s.line("Review of systems: " + self.rng.choice(self.v["ros"])).line()
        s.line("Vital signs: " + self.vitals())
        s.line("Examination: " + self.rng.choice(self.t["general_exam"]) + " "
               + " ".join(self.rng.sample(self.cond["exam"], 2))).line()
        s.line("Assessment and plan:")
        s.line(f"1. {self.cond['name'].capitalize()}. " + " ".join(self.rng.sample(self.cond["plan"], 2)))
        for med in self.cond["meds"]:
            if med not in self.meds and self.rng.random() < 0.6:
                self.start_med(s, med)
        self.events.append(Event(self.date, "admission", str(self.n_visits), f"admission {self.n_visits}", ref))
        self.queue = [self.lab_report]
        return s

    def progress_note(self) -> Section:
        s = Section("progress_note", self.date)
        s.line(f"PROGRESS NOTE - {self.service.upper()}, HOSPITAL DAY {self.day}")
        s.mark("date", f"Date of service: {self.d()}", f"    Attending: Dr. {self.attending}\n")
        s.line("Subjective: " + " ".join(self.rng.sample(self.cond["subjective"], 2)))
        s.line("Objective: " + self.vitals() + " " + self.rng.choice(self.t["general_exam"]) + " "
               + self.rng.choice(self.cond["exam"]))
        s.line("Assessment and plan:")
        s.line(f"# {self.rng.choice(self.cond['assessment'])} " + " ".join(self.rng.sample(self.cond["plan"], 2)))
        self.med_orders(s)
        for pmh in self.rng.sample(self.pmh, 1 if self.compact else 2):
            s.line(f"# {pmh.capitalize()}: {self.t['chronic_plan'][pmh]}")
        return s

    def med_orders(self, s: Section) -> None:
        done: list[str] = []  # one change per medication per note; the rest waits for the next note
        while "med_change" in self.pending and len(done) < 2:
            if not self.tracked:
                ladder = [m for m in self.changeable() if len(self.v["medications"][m]["doses"]) >= 3
                          and not self.v["medications"][m].get("course")]
                self.tracked = self.rng.sample(ladder, min(2, len(ladder)))
            pool = [m for m in self.tracked or self.changeable() if m not in done]
            if not pool:
                break
            self.pending.remove("med_change")
            done.append(self.rng.choice(pool))
            self.change_med(s, done[-1])
        others = [m for m in self.changeable() if m not in self.tracked and m not in done]
        if others and self.rng.random() < 0.15:
            self.change_med(s, self.rng.choice(others))

    def consult(self) -> Section:
        keys = [k for k in self.cond["consults"] if not any(e.key == k for e in self.events)]
        key = self.rng.choice(keys or sorted(self.v["consults"]))
        spec, name = self.v["consults"][key], self.doctor()
        s = Section("consult", self.date)
        ref = s.mark("head", f"{spec['name'].upper()} CONSULTATION\nDate: {self.d()}", "    Consultant: Dr. ")
        who = s.mark("who", name, ", MD\n")
        s.line(f"Requesting physician: Dr. {self.attending}")
        s.line(f"Reason for consultation: {self.cond['short']}.")
        s.line("Impression: " + self.rng.choice(self.cond["assessment"]))
        s.line("Recommendations:")
        for i, rec in enumerate(self.rng.sample(spec["recs"], min(3, len(spec["recs"]))), 1):
            s.line(f"{i}. {rec}")
        s.line("Thank you for this consultation; we will continue to follow.")
        self.events.append(Event(self.date, "consult", key, f"the {spec['name']} consultation", ref, name, who))
        return s

    def incident(self) -> Section:
        used = {e.key for e in self.events}
        key = next((k for k in self.incident_keys if k not in used), self.incident_keys[0])
        spec = self.v["incidents"][key]
        s = Section("incident", self.date)
        time = f"{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}"
        text = fill(self.rng.choice(spec["text"]), {**self.p, "time": time})
        ref = s.mark("what", f"{spec['title']}\nDate: {self.d()}    Author: Dr. {self.attending}\n{text}", "\n")
        if key not in used:
            self.events.append(Event(self.date, "incident", key, spec["name"], ref))
        return s

    def procedure(self) -> Section:
        spec = self.rng.choice(self.v["procedures"])
        s = Section("procedure", self.date, inert=True)
        s.line("PROCEDURE NOTE: " + spec["name"].upper())
        s.line(f"Date: {self.d()}    Operator: Dr. {self.doctor()}    Consent obtained and on chart.")
        return s.line(spec["text"])

    def discharge(self) -> Section:
        s = Section("discharge", self.date)
        admitted = next(e.date for e in reversed(self.events) if e.kind == "admission")
        ctx = self.ctx(condition=self.cond["name"], service=self.service)
        s.line(f"DISCHARGE SUMMARY - ADMISSION {self.n_visits}")
        s.add(f"Admission date: {self.d(admitted)}    ").mark("date", f"Discharge date: {self.d()}", "\n")
        s.line(f"Attending: Dr. {self.attending}    Principal diagnosis: {self.cond['name']}")
        s.line("Hospital course: " + fill(self.rng.choice(self.t["course_open"]), ctx) + " "
               + self.rng.choice(self.cond["assessment"]) + " " + fill(self.rng.choice(self.t["course_close"]), ctx))
        for e in self.events:
            if e.kind == "incident" and admitted <= e.date:
                s.line(f"The stay was complicated by {e.name} on {self.d(e.date)}.")
        stopped = [m for m in self.meds if self.v["medications"][m].get("course")]
        if stopped:
            s.line("Stopped at discharge (course completed):")
            for med in stopped:
                ref = s.mark(f"stop:{med}", f"- {med.capitalize()}", "\n")
                self.doses.append(DoseSet(self.date, med, "", ref, change=False, stop=True, date_ref=Ref(s, "date")))
                del self.meds[med]
        s.line("Discharge medications:")
        for med in self.meds:
            s.line("- " + self.med_line(med))
        s.line(f"Disposition: {self.rng.choice(self.t['dispositions'])}.")
        s.line(fill(self.rng.choice(self.t["followup"]), {**ctx, "clinic": self.rng.choice(self.v["clinics"])}))
        self.in_hospital = False
        return s

    def clinic(self) -> Section:
        self.date += dt.timedelta(days=self.rng.randint(10, 60))
        s = Section("clinic", self.date)
        s.line(f"OUTPATIENT VISIT - {self.rng.choice(self.v['clinics']).upper()}")
        s.mark("date", f"Date: {self.d()}", f"    Provider: Dr. {self.pcp}\n")
        s.line("Interval history: " + " ".join(self.rng.sample(self.v["clinic_subjective"], 2)))
        s.line(f"Vitals: BP {self.rng.randint(104, 162)}/{self.rng.randint(58, 94)} mmHg, HR "
               f"{self.rng.randint(56, 98)}, weight {self.rng.uniform(52, 118):.1f} kg.")
        s.line("Assessment and plan:")
        self.med_orders(s)
        for line in self.rng.sample(self.v["clinic_plan"], 2):
            s.line("- " + line)
        if self.rng.random() < 0.5:
            self.queue = [self.lab_report]
        return s

    def filler(self) -> Section:
        r = self.rng
        if r.random() < 0.6:
            s = Section("nursing", self.date, inert=True)
            s.line(f"NURSING NOTE - {self.d()} {r.randint(0, 23):02d}:{r.choice(['00', '15', '30', '45'])}")
            return s.line(" ".join(r.sample(self.v["nursing"], r.randint(2, 4))))
        title = r.choice(sorted(self.v["allied"]))
        s = Section("allied", self.date, inert=True)
        s.line(f"{title} - {self.d()}")
        lines = [fill(x, {"relation": self.p["relation"], "living": r.choice(self.v["living"])})
                 for x in self.v["allied"][title]]
        keep = sorted(r.sample(range(len(lines)), min(3, len(lines))))
        return s.line(" ".join(lines[i] for i in keep))

    def closing(self) -> list[Section]:
        s = self.final = Section("medication_list", self.date)
        s.line(f"ACTIVE MEDICATION LIST (reconciled {self.d()})")
        for med in self.meds:
            s.mark(f"med:{med}", "- " + self.med_line(med), "\n")
        s.line("PROBLEM LIST")
        for pmh in self.pmh:
            s.line("- " + pmh)
        return [s]
