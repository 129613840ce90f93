"""Laboratory reports and imaging studies of a simulated patient history.

A base of `medical_chart.PatientChartSimulator`: it reads and extends the chart state declared in
`medical_state.ChartState` (date, lab trajectories, the current condition, the event list).
"""

from __future__ import annotations

from longdoc.corpus.synth.medical_facts import Event, Lab
from longdoc.corpus.synth.medical_state import ChartState
from longdoc.corpus.synth.sections import Section
from longdoc.corpus.synth.text import fill


def _num(x: float, dec: int) -> str:
    return f"{x:.{dec}f}"


class DiagnosticReports(ChartState):
    def lab_report(self) -> Section:
        s = Section("labs", self.date)
        s.line("LABORATORY REPORT")
        header = s.mark("date", f"Collected: {self.d()} {self.rng.randint(4, 7):02d}:{self.rng.randint(0, 59):02d}",
                        f"    Accession: L{self.rng.randint(10**6, 10**7 - 1)}\n")
        panels = ["BASIC METABOLIC PANEL"] + [p for p, prob in (
            ("COMPLETE BLOOD COUNT", 0.75), ("MAGNESIUM", 0.4), ("HEPATIC FUNCTION PANEL", 0.15),
            ("COAGULATION", 0.15), ("CARDIAC MARKERS", 0.15), ("LACTIC ACID", 0.1), ("ENDOCRINE", 0.05),
        ) if self.rng.random() < prob * (0.3 if self.compact else 1)]
        for panel in panels:
            s.line(panel)
            for analyte in self.v["panels"][panel]:
                spec = self.v["labs"][analyte]
                prev = self.lab_state.get(analyte, spec["mean"])
                value = spec["mean"] + 0.6 * (prev - spec["mean"]) + self.rng.gauss(0, spec["sd"] * 0.8)
                floor = spec["low"] * 0.6 if spec["low"] > 0 else spec["mean"] * 0.1
                value = round(max(value, floor), spec["dec"])
                self.lab_state[analyte] = value
                text = _num(value, spec["dec"])
                flag = "H" if value > spec["high"] else "L" if value < spec["low"] else ""
                ref_range = f"{spec['low']}-{spec['high']}"
                line = f"  {spec['label']:<32}{text:>8} {flag:<2} {spec['unit']:<10} ({ref_range})"
                self.labs.append(Lab(self.date, analyte, text, value, flag,
                                     s.mark(f"lab:{analyte}", line, "\n"), header))
        return s

    def study(self) -> Section:
        keys = [k for k in self.cond_imaging() if k in self.v["imaging"]]
        recent = {e.key for e in self.events if e.kind == "study" and (self.date - e.date).days < 14}
        key = self.rng.choice([k for k in keys if k not in recent] or keys)
        spec = self.v["imaging"][key]
        s = Section("imaging", self.date)
        ref = s.mark("head", f"{spec['header']}\nDate of exam: {self.d()}",
                     f"    Accession: RAD{self.rng.randint(10**5, 10**6 - 1)}\n")
        s.line(f"Ordering physician: Dr. {self.attending if self.in_hospital else self.pcp}    "
               f"Interpreting radiologist: Dr. {self.doctor()}")
        s.line("INDICATION: " + self.rng.choice(spec["indication"]))
        s.line("TECHNIQUE: " + spec["technique"])
        prior = [e for e in self.events if e.kind == "study" and e.key == key]
        s.line("COMPARISON: " + (f"{spec['name'][0].upper()}{spec['name'][1:]} of {self.d(prior[-1].date)}."
                                 if prior else "None."))
        s.line("FINDINGS:")
        findings = self.rng.sample(spec["findings"], min(3, len(spec["findings"])))
        value, value_ref = "", None
        for f in findings:
            s.line(fill(f, {"size_word": self.rng.choice(["normal in size", "mildly enlarged"])}))
        if spec["measure"]:
            m = spec["measure"]
            value = _num(round(self.rng.uniform(m["low"], m["high"]), m["dec"]), m["dec"])
            value_ref = s.mark("measure", fill(m["template"], {"value": value, "lobe": self.rng.choice(self.v["lobes"]),
                                                   "side": self.rng.choice(["right", "left"])}), "\n")
        s.line("IMPRESSION:")
        s.line("1. " + findings[0])
        self.events.append(Event(self.date, "study", key, f"the {spec['name']}", ref, value, value_ref))
        return s

    def cond_imaging(self) -> list[str]:
        cond = getattr(self, "cond", self.v["conditions"][0])
        return cond["imaging"] + ["chest_xray", "ct_chest", "echo"]
