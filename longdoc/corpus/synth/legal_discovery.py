"""Discovery-phase papers of a simulated case file: deposition transcripts, exhibits, correspondence.

A base of `legal_case.LegalCaseSimulator`: it reads and extends the case state declared in
`legal_state.CaseState` (parties, counsel, dates, lists of depositions, invoices, demands and offers).
"""

from __future__ import annotations

import datetime as dt

from longdoc.corpus.synth.legal_facts import Dated, Deposition, Invoice
from longdoc.corpus.synth.legal_state import CaseState
from longdoc.corpus.synth.sections import Ref, Section
from longdoc.corpus.synth.text import fill, fmt_dollars, fmt_money, fmt_time, person_name

_NO_SCENE = ("expert", "surgeon", "spouse", "wife", "consultant", "vocational", "engineering")
_ARRIVAL = ("Around {time}", "I got there at about {time}", "It was {time}, give or take a few minutes.",
            "{time} I remember because I had just dropped my son at school.")
_JOBS = ("an office manager", "a school bus driver", "a dental hygienist", "an electrician", "a bookkeeper")
_TENURE = ("About {n} years.", "{n} years this coming spring.", "It will be {n} years in the fall.")


class DiscoveryPapers(CaseState):
    def deposition(self) -> Section:
        r, v, ct = self.rng, self.v, self.ct
        self.advance(1, 20)
        side = r.choice(("plaintiff", "defendant"))
        other = "defendant" if side == "plaintiff" else "plaintiff"
        is_plaintiff = side == "plaintiff" and self.p_sex and not any(x.is_plaintiff for x in self.depositions)
        role = "plaintiff" if is_plaintiff else r.choice(ct["roles_p" if side == "plaintiff" else "roles_d"])
        if is_plaintiff:
            witness, sex = self.plaintiff, self.p_sex
        else:
            first, last, sex = person_name(r, self.common, self.used)
            witness = f"{first} {last}"
        if side == "defendant" or not self.p_sex:
            employer = self.party(side)
        else:
            employer = f"{r.choice(v['company_words'])} {r.choice(['Services LLC', 'Group, Inc.', 'Partners'])}"
        position = f"I work as {r.choice(_JOBS)}." if is_plaintiff else f"I'm the {role}."
        ex, de = self.counsel[other], self.counsel[side]
        s = Section("deposition", self.date)
        head = date_ref = s.mark("date", f"DEPOSITION OF {witness.upper()}\n{self.plaintiff} v. {self.defendant}, "
                                 f"Case No. {self.case_no}\nTaken on {self.d()}",
                                 f", beginning at {fmt_time(r.randint(540, 660))}\n")
        s.line(f"Location: offices of {de['firm']}, {self.city}, {self.state}")
        s.line(f"Reported by: {r.choice(v['reporters'])}, Certified Shorthand Reporter")
        for who in ("plaintiff", "defendant"):
            s.line(f"Appearing for {who.capitalize()}: {self.counsel[who]['name']} ({self.counsel[who]['firm']})")
        s.line(f"{witness.upper()}, having been first duly sworn, testified as follows:")
        s.line(f"EXAMINATION BY {ex['title']} {ex['last'].upper()}:")
        dep = Deposition(self.date, witness, sex, employer, head, date_ref, is_plaintiff=bool(is_plaintiff))
        slots = {"witness": witness, "employer": employer, "position": position, "prior_dep": r.choice(v["prior_dep"]),
                 "education": r.choice(v["education"]),
                 "supervisor_role": r.choice(ct["roles_d"]) if side == "defendant" else "owner of the company"}
        qa = [(q, fill(a, slots), "") for q, a in v["dep_background"][: r.randint(4, 8)]]
        n = r.randint(2, 30)
        qa.append((f"How long have you worked for {employer}?", r.choice(_TENURE).format(n=n), f"{n} years"))
        who = {"any"} | ({"plaintiff"} if is_plaintiff or (side == "plaintiff" and not self.p_sex) else set()) | (
            {"defense"} if side == "defendant" else set())
        pool = [(q, a) for tag, q, a in ct["qa"] if tag in who]
        topical = [(q, a, "") for q, a in r.sample(pool, min(len(pool), r.randint(2, 3 if self.compact else 6)))]
        generic = r.sample(v["dep_generic"], 1 if self.compact else r.randint(3, 7))
        topical += [(q, fill(a, slots), "") for q, a in generic]
        if not any(w in role for w in _NO_SCENE):
            times = {dx.arrival.text for dx in self.depositions if dx.arrival}
            candidates = [fmt_time(r.randint(60, 240) * 5) for _ in range(20)]
            t = next((x for x in candidates if x not in times), candidates[0])  # distinct while they last
            topical.insert(r.randrange(len(topical) + 1), (
                f"What time did you arrive at {self.place} on {self.d(self.incident)}?",
                r.choice(_ARRIVAL).format(time=t), t))
        if self.invoices and r.random() < 0.5:
            inv = r.choice(self.invoices)
            topical.insert(r.randrange(len(topical) + 1), (
                f"Let me hand you what has been marked as Exhibit {inv.exhibit}. Do you recognize this document?",
                f"Yes. It's the invoice from {inv.vendor}.", f"exhibit:{inv.exhibit}"))
        for i, (q, a, fact) in enumerate(qa + topical):
            s.line(f"Q. {q}")
            if i >= len(qa) and r.random() < 0.15:  # objections to substance, not to the background questions
                s.line(f"{de['title']} {de['last'].upper()}: {r.choice(v['objections'])}")
                if r.random() < 0.5:
                    s.line(f"BY {ex['title']} {ex['last'].upper()}:")
            if fact.startswith("exhibit:"):
                dep.shown.append((int(fact.split(":")[1]), s.mark("shown", f"A. {a}", "\n")))
            elif fact.endswith("years"):
                dep.tenure = Dated(self.date, fact, s.mark("tenure", f"A. {a}", "\n"))
            elif fact:
                dep.arrival = Dated(self.date, fact, s.mark("arrival", f"A. {a}", "\n"))
            else:
                s.line(f"A. {a}")
        s.line(f"{ex['title']} {ex['last'].upper()}: {r.choice(v['dep_close'])}")
        s.line(f"(Whereupon, the deposition concluded at {fmt_time(r.randint(780, 1020))})")
        s.line("REPORTER'S CERTIFICATE: I certify that the witness was duly sworn and that the foregoing is a "
               "true record of the testimony given.")
        self.depositions.append(dep)
        return s

    def invoice_exhibit(self) -> Section:
        r = self.rng
        self.advance(1, 10)
        self.exhibits += 1
        used = {i.number for i in self.invoices}
        number = next(x for x in (f"{r.choice('ABCDEFHJKLMNPRSTW')}-{r.randint(1000, 99999)}" for _ in range(99))
                      if x not in used)
        vendor = r.choice(sorted(self.ct["vendors"]))
        when = self.incident + dt.timedelta(days=r.randint(1, max(2, (self.date - self.incident).days)))
        s = Section("exhibit", self.date)
        s.line(f"EXHIBIT {self.exhibits}")
        s.line(vendor.upper()).line("INVOICE")
        number_ref = s.add("Invoice No.: ").mark("number", number, "\n")
        s.line(f"Invoice date: {self.d(when)}    Terms: Net 30")
        s.line(f"Bill to: {self.party(self.ct.get('bill_to', 'plaintiff'))}")
        items = self.ct["vendors"][vendor]
        cents = [r.randint(2_000, 300_000) * 5 for _ in range(r.randint(1, len(items)))]
        for item, amount in zip(r.sample(items, len(cents)), cents):
            s.line(f"  {item:<48}{fmt_money(amount):>16}")
        total = fmt_money(sum(cents))
        ref = s.mark("total", f"TOTAL DUE: {total}", "\n")
        s.line("Please remit payment within 30 days. Thank you for your business.")
        self.invoices.append(Invoice(number, number_ref, vendor, Dated(when, total, ref, sum(cents)), self.exhibits))
        return s

    def exhibit(self) -> Section:
        r, v = self.rng, self.v
        self.exhibits += 1
        s = Section("exhibit", self.date)
        s.line(f"EXHIBIT {self.exhibits}")
        kind = r.choice(v["exhibit_kinds"])
        names = [" ".join(person_name(r, self.common)[:2]) for _ in range(2)]
        if kind == "email":
            dom = self.d_short.lower().replace(" ", "") + ".com"
            when = self.incident + dt.timedelta(days=r.randint(-60, 30))
            s.line(f"From: {names[0]} <{names[0].split()[0].lower()}@{dom}>")
            s.line(f"To: {names[1]} <{names[1].split()[0].lower()}@{dom}>")
            s.line(f"Sent: {self.d(when)} {fmt_time(r.randint(420, 1200))}")
            s.line(f"Subject: {r.choice(v['email_subjects'])}")
            s.line(" ".join(r.sample(v["email_bodies"], 2))).line(names[0].split()[0])
        elif kind == "report":
            s.line(f"{self.d_short.upper()} INTERNAL REPORT - CONFIDENTIAL")
            s.line(f"Subject: {self.ct['incident']} at {self.place}. Prepared by {names[0]}.")
            s.line(" ".join(r.sample(v["report_lines"], 3)))
        elif kind == "photos":
            s.line(f"PHOTOGRAPH LOG - taken by {names[0]}")
            s.line(f"Location: {self.place}")
            for i, view in enumerate(r.sample(v["photo_views"], r.randint(3, 5)), 1):
                s.line(f"Photo {i}: {view}.")
        else:
            s.line(f"{self.ct['agreement'].upper()} (EXCERPT)")
            s.line(f"This {self.ct['agreement']} is entered into as of {self.d(self.agreement_date)} between the "
                   "parties identified on the signature page.")
            s.line("Section 7.2. Notices under this agreement must be in writing and delivered to the addresses "
                   "listed in Schedule B. Section 12.1. This agreement is governed by the laws of the State of "
                   f"{self.state}.")
        return s

    def letter(self, side: str, before: list[str], key_line: str = "", after: tuple[str, ...] = ()):
        """A letter between counsel; `key_line` (if any) is marked and its reference returned."""
        c, to = self.counsel[side], self.counsel["defendant" if side == "plaintiff" else "plaintiff"]
        s = Section("letter", self.date, inert=not key_line)
        s.line(c["firm"].upper()).line(f"{self.city}, {self.state}").mark("date", self.d(), "\n")
        s.line(f"VIA ELECTRONIC MAIL: {to['name']}, {to['firm']}")
        s.line(f"Re: {self.plaintiff} v. {self.defendant}, Case No. {self.case_no}")
        s.line(f"Dear {to['title'].title()} {to['last']}:")
        for line in before:
            s.line(line)
        ref = s.mark("amount", key_line, "\n") if key_line else None
        for line in after:
            s.line(line)
        return s.line("Sincerely,").line(c["name"]), ref

    def settlement(self, side: str) -> Section:
        r = self.rng
        self.advance()
        mine, theirs = (self.demands, self.offers) if side == "plaintiff" else (self.offers, self.demands)
        if side == "plaintiff":
            prev = mine[-1].value if mine else int(self.damages * r.uniform(0.6, 1.0))
            floor = theirs[-1].value + 10_000 if theirs else 0
            amount = max(floor, int(prev * r.uniform(0.7, 0.93)) // 5000 * 5000)
        else:
            prev = mine[-1].value if mine else int(theirs[-1].value * r.uniform(0.04, 0.15)) if theirs else 25_000
            cap = theirs[-1].value - 10_000 if theirs else self.damages
            amount = min(cap, int(prev * r.uniform(1.2, 1.8)) // 5000 * 5000 if mine else prev // 5000 * 5000 + 5000)
        if mine and amount == mine[-1].value:
            amount += 5000 if side == "defendant" else -5000
        key_line = fill(r.choice(self.v["demand_lines" if side == "plaintiff" else "offer_lines"]),
                        {"amount": fmt_dollars(amount)})
        opener = fill(r.choice(self.v["letter_openers"]), {"client": self.party(side)})
        s, ref = self.letter(side, [opener], key_line, (r.choice(self.v["letter_closers"]),))
        mine.append(Dated(self.date, fmt_dollars(amount), ref, amount, Ref(s, "date")))
        return s

    def demand(self) -> Section:
        return self.settlement("plaintiff")

    def offer(self) -> Section:
        if not self.demands:
            return self.settlement("plaintiff")
        return self.settlement("defendant")

    def meet_confer(self) -> Section:
        self.advance()
        side = self.rng.choice(("plaintiff", "defendant"))
        body = [fill(self.rng.choice(self.v["letter_openers"]), {"client": self.party(side)})]
        lines = self.v["meet_confer"]
        body += [lines[i] for i in sorted(self.rng.sample(range(len(lines)), 2 if self.compact else 3))]
        return self.letter(side, body)[0]
