"""PDF, DOCX and HTML files built from text, deterministically and offline, for the document-format tests.

    pdf = make_pdf([["page one, line one", "line two"], [], ["page three"]])   # [] = a page with no text layer
    make_docx(path, [("h1", "Title"), ("p", "A paragraph."), ("table", [["a", "b"], ["c", "d"]])])
    files = mixed_folder(tmp_path / "docs")    # a PDF, a DOCX, an HTML and a text file, plus an unsupported .png

The PDF is written by hand (PDF 1.4, one Helvetica 11pt text line per Tj, a correct xref table), so the tests
do not depend on a PDF writer; DOCX files are written with python-docx (the `docs` extra).
"""

from __future__ import annotations

from pathlib import Path


def make_pdf(pages: list[list[str]]) -> bytes:
    """A valid PDF with one page per list of lines (ASCII text, top to bottom); an empty list draws a grey box
    and no text, as a scanned page looks to a text extractor."""
    objects: list[str] = ["<< /Type /Catalog /Pages 2 0 R >>", "",
                          "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for lines in pages:
        esc = [ln.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") for ln in lines]
        body = "".join(f"BT /F1 11 Tf 72 {720 - 14 * i} Td ({t}) Tj ET\n" for i, t in enumerate(esc))
        body = body or "0.5 g 72 72 468 648 re f\n"
        objects.append(f"<< /Length {len(body.encode('latin-1'))} >>\nstream\n{body}endstream")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {len(objects)} 0 R "
                       f"/Resources << /Font << /F1 3 0 R >> >> >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for n, obj in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n{obj}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def make_docx(path: Path, blocks: list[tuple[str, object]]) -> Path:
    """A .docx of ("title" | "h1".."h3" | "p", text) and ("table", rows of cell texts) blocks."""
    import docx

    d = docx.Document()
    for kind, value in blocks:
        if kind == "title":
            d.add_heading(str(value), level=0)
        elif kind.startswith("h"):
            d.add_heading(str(value), level=int(kind[1:]))
        elif kind == "p":
            d.add_paragraph(str(value))
        else:
            rows = list(value)  # type: ignore[call-overload]
            table = d.add_table(rows=len(rows), cols=len(rows[0]))
            for r, row in enumerate(rows):
                for c, text in enumerate(row):
                    table.cell(r, c).text = text
    d.save(str(path))
    return path


# A contract, wrapped as a PDF would wrap it: pages with a running header and footer, words hyphenated at
# line ends ("pro-" / "vision"), a hyphenated name that must stay ("Smith-" / "Jones").
CONTRACT_PAGES = [
    ["MASTER SERVICES AGREEMENT", "1. The Supplier has its principal place of business in Leeds.",
     "2. The pro-", "vision of services starts on 1 May 2026.", "Page 1 of 3"],
    ["MASTER SERVICES AGREEMENT", "3. Fees are payable monthly to Smith-", "Jones Ltd within thirty days.",
     "Page 2 of 3"],
    ["MASTER SERVICES AGREEMENT", "4. Either party may terminate on ninety days notice.", "Page 3 of 3"],
]
CONTRACT_TEXT = ("1. The Supplier has its principal place of business in Leeds.\n2. The provision of services "
                 "starts on 1 May 2026.\n\n3. Fees are payable monthly to Smith-\nJones Ltd within thirty days."
                 "\n\n4. Either party may terminate on ninety days notice.")

DOCX_BLOCKS: list[tuple[str, object]] = [
    ("title", "Patient History"), ("p", "Admitted on 3 March 2024 with chest pain."),
    ("h1", "Medications"), ("p", "Aspirin 75 mg daily."), ("table", [["Drug", "Dose"], ["Bisoprolol", "5 mg"]]),
    ("h2", "Allergies"), ("p", "Penicillin (rash)."),
]
DOCX_TEXT = ("Patient History\nAdmitted on 3 March 2024 with chest pain.\n\nMedications\nAspirin 75 mg daily.\n"
             "Drug\tDose\nBisoprolol\t5 mg\n\nAllergies\nPenicillin (rash).")

HTML = """<!DOCTYPE html><html><head><title>Ignored title</title><style>p { color: red }</style>
<script>var x = "not text";</script></head>
<body><h1>Lease   terms</h1><p>The rent is <b>1,200 EUR</b>
per month &amp; due on the first day.</p><div>Deposit: two months</div>
<h2>Parties</h2><table><tr><th>Landlord</th><td>A. Jones</td></tr></table>
<pre>Clause 9
  kept   as written</pre><p>Signed<br>in Leeds</p></body></html>"""
HTML_TEXT = ("Lease terms\nThe rent is 1,200 EUR per month & due on the first day.\nDeposit: two months\n\nParties\n"
             "Landlord\tA. Jones\nClause 9\n  kept   as written\nSigned\nin Leeds")


def mixed_folder(root: Path) -> dict[str, Path]:
    """A folder with contract.pdf, history.docx, lease.html, notes.txt, and scan.png (unsupported)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {"pdf": root / "contract.pdf", "docx": root / "history.docx", "html": root / "lease.html",
             "txt": root / "notes.txt", "png": root / "scan.png"}
    files["pdf"].write_bytes(make_pdf(CONTRACT_PAGES))
    make_docx(files["docx"], DOCX_BLOCKS)
    files["html"].write_text(HTML, encoding="utf-8")
    files["txt"].write_text("Call the clerk on Monday about the hearing.\n", encoding="utf-8")
    files["png"].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    return files
