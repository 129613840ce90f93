"""Synthetic litigation case files: the simulator, with the pleadings, motions and orders it writes.

The case is simulated paper by paper, so facts stay consistent (the trial date in effect, the
latest settlement demand, which exhibit a witness was shown). The state is declared in
`legal_state.py`, the planted facts in `legal_facts.py`, the discovery papers (depositions, exhibits,
letters) in `legal_discovery.py`. Vocabulary and text live in `data/synth/legal/*.json`; questions are
built by `legal_qa.py`.
"""

from __future__ import annotations

import datetime as dt
import random

from longdoc.corpus.synth.legal_discovery import DiscoveryPapers
from longdoc.corpus.synth.legal_facts import Dated, Motion, TrialSetting
from longdoc.corpus.synth.sections import Ref, Section
from longdoc.corpus.synth.text import DATE_STYLES, fill, fmt_dollars, load_data, person_name


class LegalCaseSimulator(DiscoveryPapers):
    """A `simulator.Simulator` of one lawsuit, from the complaint on (state: `legal_state.CaseState`)."""

    def __init__(self, rng: random.Random, target: int, seed_key: str):
        self.rng, self.seed_key = rng, seed_key
        v = self.v = load_data("legal", "vocab")
        self.common, self.used = load_data("common", "names"), set()
        self.style = rng.choice(DATE_STYLES)
        self.ckey = rng.choice(sorted(v["case_types"]))
        ct = self.ct = v["case_types"][self.ckey]
        self.city, self.state = rng.choice(self.common["cities"])
        self.court = fill(rng.choice(v["courts"]), {"city": self.city, "state": self.state})
        self.judge = "Hon. " + " ".join(person_name(rng, self.common, self.used)[:2])
        self.d_short = rng.choice(v["company_words"])
        self.defendant = f"{self.d_short} {rng.choice(ct['defendant_suffix'])}"
        if ct["plaintiff"] == "company":
            self.p_short = rng.choice([w for w in v["company_words"] if w != self.d_short])
            self.plaintiff, self.p_sex = f"{self.p_short} {rng.choice(ct['plaintiff_suffix'])}", ""
        else:
            first, last, self.p_sex = person_name(rng, self.common, self.used, ct.get("plaintiff_sex"))
            self.plaintiff, self.p_short = f"{first} {last}", f"{'Ms.' if self.p_sex == 'F' else 'Mr.'} {last}"
        self.counsel = {side: self.lawyer() for side in ("plaintiff", "defendant")}
        self.incident = dt.date(rng.randint(2015, 2021), rng.randint(1, 12), rng.randint(1, 28))
        self.agreement_date = self.incident - dt.timedelta(days=rng.randint(200, 900))
        self.address = f"{rng.randint(100, 9800)} {rng.choice(self.common['streets'])}, {self.city}, {self.state}"
        streets = rng.sample(self.common["streets"], 2)
        self.place = fill(ct["location"], {"p_short": self.p_short, "d_short": self.d_short,
                                           "address": self.address, "street": streets[0],
                                           "street2": streets[1], "city": self.city})
        self.date = self.incident + dt.timedelta(days=rng.randint(60, 400))
        year = self.date.year
        self.case_no = (f"{rng.randint(1, 3)}:{year % 100}-cv-{rng.randint(100, 9999):05d}"
                        if self.court.startswith("United States") else f"{year}-CV-{rng.randint(1000, 99999)}")
        self.damages = rng.randint(15, 900) * 5000
        self.trial = []
        self.demands = []
        self.offers = []
        self.depositions = []
        self.invoices = []
        self.motions = []
        self.exhibits = 0
        self.facts = {}
        self.compact = target < 6000
        scale = target / 32768
        plot = (["deposition"] * min(30, max(2, round(5 * scale))) + ["invoice"] * min(25, max(2, round(4 * scale)))
                + ["demand"] * min(10, max(2, round(2 * scale) + 1)) + ["offer"] * min(10, max(1, round(2 * scale)))
                + ["motion"] * min(12, max(1, round(3 * scale))) + ["continuance"] * min(8, max(1, round(1.5 * scale))))
        self.plot = sorted((rng.uniform(0.05, 0.9), what) for what in plot)
        self.pending = ["answer", "scheduling"]

    # ------------------------------------------------------------------ helpers
    def title(self) -> str:
        return f"{self.plaintiff} v. {self.defendant}, No. {self.case_no} ({self.ct['title']})"

    def lawyer(self) -> dict[str, str]:
        first, last, sex = person_name(self.rng, self.common, self.used)
        a, b = self.rng.sample(self.v["firm_words"], 2)
        return {"name": f"{first} {last}", "last": last, "title": "MS." if sex == "F" else "MR.",
                "firm": fill(self.rng.choice(self.v["firm_forms"]), {"a": a, "b": b})}

    def ctx(self, **extra) -> dict:
        return {"plaintiff": self.plaintiff, "defendant": self.defendant, "p_short": self.p_short,
                "d_short": self.d_short, "location": self.place, "incident_date": self.d(self.incident),
                "agreement_date": self.d(self.agreement_date), "agreement": self.ct["agreement"], **extra}

    def caption(self, s: Section, mark: bool = False) -> None:
        s.line(f"IN THE {self.court.upper()}")
        s.line(f"{self.plaintiff.upper()}, Plaintiff, v. {self.defendant.upper()}, Defendant.")
        if mark:
            s.add("Case No. ").mark("case_no", self.case_no, "    ")
            s.add("Assigned to the ").mark("judge", self.judge, "\n")
        else:
            s.line(f"Case No. {self.case_no}    {self.judge}")

    def signature(self, s: Section, side: str, key: str = "") -> None:
        c = self.counsel[side]
        s.line(f"Dated: {self.d()}    Respectfully submitted,")
        s.line(f"/s/ {c['name']}")
        firm = f"{c['firm']}, {self.address_of(side)}"
        s.mark(key, firm, "\n") if key else s.line(firm)
        s.line(f"Attorneys for {side.capitalize()} {self.party(side)}")

    def address_of(self, side: str) -> str:
        return f"{self.city}, {self.state}"

    # ------------------------------------------------------------------ sections
    def opening(self) -> list[Section]:
        s = Section("complaint", self.date)
        self.caption(s, mark=True)
        title = self.ct["complaint_title"] + " AND DEMAND FOR JURY TRIAL"
        self.facts["filed"] = Dated(self.date, self.d(), s.mark("filed", f"{title}\nFiled: {self.d()}", "\n\n"))
        s.line(f"Plaintiff {self.plaintiff}, by and through undersigned counsel, alleges as follows:").line()
        s.line("PARTIES, JURISDICTION, AND VENUE")
        who = "a resident of" if self.p_sex else "a corporation with its principal place of business in"
        s.line(f"1. Plaintiff {self.plaintiff} is {who} {self.city}, {self.state}.")
        s.line(f"2. Defendant {self.defendant} is a corporation that does business in {self.state} and may be "
               "served through its registered agent.")
        s.line("3. The amount in controversy exceeds the jurisdictional minimum of this Court, and venue is proper "
               "because the events giving rise to these claims occurred in this county.").line()
        s.line("FACTUAL ALLEGATIONS")
        n = 4
        facts = self.ct["facts"] if not self.compact else self.ct["facts"][:5]
        for fact in facts:
            text = f"{n}. " + fill(fact, self.ctx())
            if "{incident_date}" in fact and "incident" not in self.facts:
                self.facts["incident"] = Dated(self.incident, self.d(self.incident), s.mark("incident", text, "\n"))
            else:
                s.line(text)
            n += 1
        for i, cause in enumerate(self.ct["causes"][: 2 if self.compact else 4], 1):
            s.line().line(f"COUNT {['I', 'II', 'III', 'IV'][i - 1]} - {cause.upper()}")
            s.line(f"{n}. Plaintiff incorporates the preceding paragraphs as if fully set forth here.")
            s.line(f"{n + 1}. Defendant's conduct described above constitutes {cause.lower()}, and Plaintiff "
                   "was damaged as a result.")
            n += 2
        s.line().line("PRAYER FOR RELIEF")
        money = fmt_dollars(self.damages)
        prayer = (f"WHEREFORE, Plaintiff demands judgment against Defendant in an amount not less than {money}, "
                  "together with pre- and post-judgment interest, costs, and such other relief as the Court "
                  "deems just.")
        self.facts["damages"] = Dated(self.date, money, s.mark("damages", prayer, "\n"), self.damages)
        self.signature(s, "plaintiff", key="firm_plaintiff")
        return [s]

    def next(self, progress: float) -> Section:
        while self.plot and self.plot[0][0] <= progress:
            self.pending.append(self.plot.pop(0)[1])
        if self.pending[:1] in (["answer"], ["scheduling"]):
            return getattr(self, self.pending.pop(0))()
        if self.trial and self.date + dt.timedelta(days=45) >= self.trial[-1].trial:
            return self.order_reset()
        unruled = [m for m in self.motions if not m.ruled]
        if unruled and self.rng.random() < 0.35:
            return self.order(unruled[0])
        if self.pending:
            what = self.pending.pop(0)
            return {"deposition": self.deposition, "invoice": self.invoice_exhibit, "demand": self.demand,
                    "offer": self.offer, "motion": self.motion, "continuance": lambda: self.motion("continue")}[what]()
        r = self.rng.random()
        if r < 0.5:
            return self.deposition()
        return self.exhibit() if r < 0.8 else self.meet_confer()

    def answer(self) -> Section:
        self.advance(21, 60)
        s = Section("answer", self.date)
        self.caption(s)
        self.facts["answer"] = Dated(self.date, self.d(), s.mark(
            "filed", f"DEFENDANT'S ANSWER AND AFFIRMATIVE DEFENSES\nFiled: {self.d()}", "\n"))
        s.line(f"Defendant {self.defendant} answers the Complaint as follows:")
        for n in range(1, (8 if self.compact else 14)):
            s.line(f"{n}. " + self.rng.choice(self.v["answer_responses"]))
        s.line("AFFIRMATIVE DEFENSES")
        defenses = self.ct["defenses"] + self.v["defenses_generic"]
        for i, text in enumerate(self.rng.sample(defenses, 3 if self.compact else 5), 1):
            s.line(f"{['First', 'Second', 'Third', 'Fourth', 'Fifth'][i - 1]} Defense: {text}")
        self.signature(s, "defendant", key="firm_defendant")
        return s

    def scheduling(self) -> Section:
        self.advance(20, 50)
        s = Section("scheduling_order", self.date)
        self.caption(s)
        s.line("SCHEDULING ORDER")
        s.line("Pursuant to the rules of civil procedure and after a case management conference, the Court ORDERS:")
        trial = self.date + dt.timedelta(days=self.rng.randint(300, 480))
        for label, days in (("Amendment of pleadings", 60), ("Close of fact discovery", 180),
                            ("Expert disclosures", 210), ("Dispositive motions", 240), ("Mediation", 260)):
            s.line(f"- {label}: {self.d(self.date + dt.timedelta(days=days))}")
        text = f"Trial is set for {self.d(trial)} at 9:00 a.m. before the {self.judge}."
        self.trial.append(TrialSetting(self.date, trial, self.d(trial), s.mark("trial", text, "\n"), Ref(s, "ordered")))
        self.so_ordered(s)
        return s

    def motion(self, key: str | None = None) -> Section:
        self.advance()
        used = {(m.side, m.key) for m in self.motions}
        side = self.rng.choice(("plaintiff", "defendant"))
        if key is None:
            options = [k for k in sorted(self.v["motions"]) if k != "continue" and (side, k) not in used]
            key = self.rng.choice(options or sorted(self.v["motions"]))
        spec, other = self.v["motions"][key], "defendant" if side == "plaintiff" else "plaintiff"
        s = Section("motion", self.date)
        self.caption(s)
        title = f"{side.upper()}'S {spec['title']}"
        filed = Dated(self.date, self.d(), s.mark("filed", f"{title}\nFiled: {self.d()}", "\n"))
        s.line(f"{side.capitalize()} {self.party(side)} respectfully moves for the relief described below and states:")
        slots = {"movant": side.capitalize(), "opponent": other.capitalize()}
        for i, arg in enumerate(spec["args"][: 2 if self.compact else 4], 1):
            s.line(f"{i}. " + fill(arg, slots))
        s.line(f"WHEREFORE, {side.capitalize()} respectfully requests that the Court grant this motion.")
        self.signature(s, side)
        self.motions.append(Motion(side, key, f"{side}'s {spec['short']}", filed))
        return s

    def order(self, m: Motion) -> Section:
        self.advance(7, 40)
        spec = self.v["motions"][m.key]
        s = Section("order", self.date)
        self.caption(s)
        s.line(f"ORDER ON {m.side.upper()}'S {spec['title']}")
        s.line(f"This matter comes before the Court on the {m.name.replace(spec['short'], spec['name'])}, filed "
               f"{m.filed.text}. " + self.rng.choice(self.v["order_reasons"]))
        ruling = "GRANTED" if m.key == "continue" else self.rng.choice(self.v["rulings"])
        s.line(f"IT IS ORDERED that the motion is {ruling}.")
        if m.key == "continue":
            self.reset_trial(s)
        s.line(self.rng.choice(self.v["order_extra"]))
        self.so_ordered(s)
        m.ruled = True
        return s

    def order_reset(self) -> Section:
        self.advance(1, 5)
        s = Section("order", self.date)
        self.caption(s)
        s.line("ORDER RESETTING TRIAL DATE")
        s.line("Due to the congestion of the Court's trial calendar, and on the Court's own motion, IT IS ORDERED:")
        self.reset_trial(s)
        self.so_ordered(s)
        return s

    def so_ordered(self, s: Section) -> None:
        s.mark("ordered", f"SO ORDERED on {self.d()}.", f"    {self.judge}, Judge\n")

    def reset_trial(self, s: Section) -> None:
        old = self.trial[-1].trial
        new = max(old, self.date) + dt.timedelta(days=self.rng.randint(60, 200))
        text = f"Trial, previously set for {self.d(old)}, is continued to {self.d(new)}."
        self.trial.append(TrialSetting(self.date, new, self.d(new), s.mark("trial", text, "\n"), Ref(s, "ordered")))

    def filler(self) -> Section:
        title, body = self.rng.choice(self.v["notices"])
        side = self.rng.choice(("plaintiff", "defendant"))
        c = self.counsel[side]
        s = Section("notice", self.date, inert=True)
        s.line(f"{title} ({self.plaintiff} v. {self.defendant}, Case No. {self.case_no})")
        s.line(fill(body, {"attorney": c["name"], "firm": c["firm"], "party": side.capitalize(), "date": self.d(),
                           "vendor": self.rng.choice(sorted(self.ct["vendors"])),
                           "judge": self.judge.removeprefix("Hon. ")}))
        return s.line(f"/s/ {c['name']}, {c['firm']}")

    def closing(self) -> list[Section]:
        return []
