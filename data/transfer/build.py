# Rebuilds licenses-qa.jsonl from /usr/share/common-licenses (Debian): python3 data/transfer/build.py
# ruff: noqa: E501 - the hand-written questions are data, one (question, answer) pair per line
import json

L='/usr/share/common-licenses/'
qa = {
 "Apache-2.0": [("In which month and year was version 2.0 of the Apache License released?", "January 2004"),
                ("What is the title of section 6 of the license?", "Trademarks"),
                ("What is the title of section 5 of the license?", "Submission of Contributions"),
                ("What is the title of section 3 of the license?", "Grant of Patent License"),
                ("What is the title of section 8 of the license?", "Limitation of Liability")],
 "MPL-2.0": [("After receiving a notice of non-compliance, within how many days must You become compliant for your grants to be reinstated?", "30 days"),
             ("Under section 5.1, a Contributor must notify You of non-compliance prior to how many days after You have come back into compliance?", "60 days"),
             ("What is the title of section 8?", "Litigation"),
             ("Litigation relating to this License may be brought only in the courts of a jurisdiction where which party maintains its principal place of business?", "the defendant"),
             ("Which version of the GNU Lesser General Public License is named as a Secondary License?", "2.1")],
 "GPL-2": [("In which month and year was version 2 of the GNU General Public License published?", "June 1991"),
           ("A written offer to give the source code must be valid for at least how many years?", "three"),
           ("What is the name of the program in the sample copyright disclaimer?", "Gnomovision"),
           ("Which company disclaims all copyright interest in the sample copyright disclaimer?", "Yoyodyne, Inc."),
           ("Whose signature is on the sample copyright disclaimer?", "Ty Coon"),
           ("What is Ty Coon's title?", "President of Vice")],
 "GFDL-1.3": [("On what date was version 1.3 of the GNU Free Documentation License released?", "3 November 2008"),
              ("Printed copies numbering more than how many must be enclosed in covers that carry the Cover Texts?", "100"),
              ("Before what date may the operator of an MMC Site republish an MMC under CC-BY-SA?", "August 1, 2009"),
              ("In which city does Creative Commons Corporation have its principal place of business?", "San Francisco"),
              ("What is the title of section 11?", "RELICENSING"),
              ("Works incorporated into an MMC must have been incorporated prior to what date to be eligible for relicensing?", "November 1, 2008")],
 "LGPL-2.1": [("In which month and year was version 2.1 of the GNU Lesser General Public License published?", "February 1999"),
              ("What is the name of the library in the sample copyright disclaimer?", "Frob"),
              ("Who wrote the library in the sample copyright disclaimer?", "James Random Hacker"),
              ("On what date is the sample copyright disclaimer signed?", "1 April 1990"),
              ("Which license is this license the successor of?", "GNU Library Public License")],
}
with open('data/transfer/licenses-qa.jsonl','w') as f:
    for name, pairs in qa.items():
        doc = open(L+name).read()
        for _, a in pairs:
            assert a in doc, (name, a)  # every answer is quoted from the license text
        rows = [{"id": f"{name}#{i}", "question": q, "answer": a, "kind": "lookup"} for i, (q, a) in enumerate(pairs)]
        f.write(json.dumps({"doc_id": name, "document": doc, "qa": rows}) + "\n")
print(sum(len(v) for v in qa.values()))
