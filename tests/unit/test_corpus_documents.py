"""PDF, DOCX and HTML documents in (longdoc.corpus.documents through the shared reader): text, page and section
boundaries, hyphens and running headers, scanned PDFs, folders where every file is read or reported."""

from __future__ import annotations

import sys

import pytest

from longdoc.corpus import documents
from longdoc.corpus.ingest import CorpusError, Skips, read_documents
from tests.support.document_files import (
    CONTRACT_PAGES,
    CONTRACT_TEXT,
    DOCX_BLOCKS,
    DOCX_TEXT,
    HTML,
    HTML_TEXT,
    make_docx,
    make_pdf,
    mixed_folder,
)

pytest.importorskip("pypdf")
pytest.importorskip("docx")


def _norm(text: str) -> str:
    return " ".join(text.split())


def test_pdf_pages_hyphens_and_running_header_footer(tmp_path):
    path = tmp_path / "contract.pdf"
    path.write_bytes(make_pdf(CONTRACT_PAGES))
    (doc,) = read_documents([str(path)])
    assert doc["text"] == CONTRACT_TEXT  # header and "Page N of 3" gone, "pro-/vision" joined, "Smith-/Jones" kept
    assert doc["doc_id"] == "contract.pdf" and doc["source"] == str(path)
    pages = [doc["text"][a:b] for a, b in doc["pages"]]
    assert pages[0].startswith("1. The Supplier") and pages[0].endswith("1 May 2026.")
    assert pages[1] == "3. Fees are payable monthly to Smith-\nJones Ltd within thirty days."
    assert pages[2] == "4. Either party may terminate on ninety days notice."


def test_short_pdf_keeps_its_first_and_last_lines(tmp_path):
    # Two pages are too few to tell a running header from text that happens to repeat.
    path = tmp_path / "two.pdf"
    path.write_bytes(make_pdf(CONTRACT_PAGES[:2]))
    text = documents.read(path).text
    assert text.count("MASTER SERVICES AGREEMENT") == 2 and "Page 2 of 3" in text


@pytest.mark.parametrize("repeats, dropped", [(3, True), (2, False)])
def test_header_must_repeat_on_60_percent_of_pages(repeats, dropped):
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    pages = [("Confidential\n" if i < repeats else "") + f"{w.title()} opens page {i}.\nIt ends with {w}.\n- {i + 1} -"
             for i, w in enumerate(words)]
    out = documents.drop_repeated_lines(pages)
    assert all(("Confidential" in p) != dropped for p in out[:repeats])
    # the page number ("- 3 -", digits ignored) goes on every page; the body's lines stay
    assert out[2].endswith("It ends with gamma.") and all("opens page" in p for p in out)
    table = [f"{w} row\n{1000 + i},{i}00 {i}.25 {i}.50 {i}.75" for i, w in enumerate(words)]  # no letters, long: data
    assert documents.drop_repeated_lines(table) == table


@pytest.mark.parametrize("text, joined", [
    ("the pro-\nvision of", "the provision of"),
    ("Smith-\nJones", "Smith-\nJones"),         # a capital after the break: a real compound or a name
    ("pre-\n2020 rules", "pre-\n2020 rules"),   # a digit: kept
    ("self-\n  evident", "selfevident"),         # the next line's indent does not matter
    ("non-\nText", "non-\nText"),
    ("end -\nnext", "end -\nnext"),              # a dash after a space is punctuation, not a hyphen
])
def test_join_hyphens(text, joined):
    assert documents.join_hyphens(text) == joined


def test_scanned_pdf_is_named_not_an_empty_document(tmp_path):
    path = tmp_path / "scan.pdf"
    path.write_bytes(make_pdf([[], []]))
    with pytest.raises(CorpusError, match=r"scan\.pdf: no text layer.*a scanned PDF\? OCR is not supported.*ocrmypdf"):
        list(read_documents([str(path)]))
    skips = Skips()
    assert list(read_documents([str(path)], skips=skips)) == []
    assert skips.counts == {"no text layer": 1} and "scan.pdf" in skips.summary()


def test_pdf_with_one_blank_page_keeps_the_others(tmp_path):
    path = tmp_path / "mixed.pdf"
    path.write_bytes(make_pdf([["Page one text."], [], ["Page three text."]]))
    doc = documents.read(path)
    assert doc.text == "Page one text.\n\nPage three text."
    assert doc.pages == [[0, 14], [14, 14], [16, 32]]


def test_damaged_pdf_is_an_unreadable_file(tmp_path):
    path = tmp_path / "broken.pdf"
    path.write_bytes(b"%PDF-1.4\nthis is not a PDF body")
    skips = Skips()
    assert list(read_documents([str(path)], skips=skips)) == []
    assert skips.counts == {"unreadable file": 1} and "broken.pdf: not a readable PDF file" in skips.examples[0]


def test_docx_paragraphs_headings_and_tables(tmp_path):
    path = make_docx(tmp_path / "history.docx", DOCX_BLOCKS)
    (doc,) = read_documents([str(path)])
    assert doc["text"] == DOCX_TEXT
    assert [(s["title"], s["level"]) for s in doc["sections"]] == [("Patient History", 1), ("Medications", 1),
                                                                   ("Allergies", 2)]
    for s in doc["sections"]:
        assert doc["text"][s["start"]:].startswith(s["title"])
    assert "pages" not in doc


def test_html_text_sections_and_dropped_script(tmp_path):
    path = tmp_path / "lease.htm"
    path.write_text(HTML, encoding="utf-8")
    (doc,) = read_documents([str(path)])
    assert doc["text"] == HTML_TEXT
    assert "not text" not in doc["text"] and "color" not in doc["text"] and "Ignored title" not in doc["text"]
    assert [(s["title"], s["level"], doc["text"][s["start"]:s["start"] + len(s["title"])])
            for s in doc["sections"]] == [("Lease terms", 1, "Lease terms"), ("Parties", 2, "Parties")]


def test_html_declared_charset(tmp_path):
    path = tmp_path / "old.html"
    path.write_bytes('<html><head><meta charset="iso-8859-1"></head><body><p>Caf\xe9 Zo\xeb</p></body></html>'
                     .encode("latin-1"))
    assert documents.read(path).text == "Caf\u00e9 Zo\u00eb"


def test_missing_library_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "a.pdf"
    path.write_bytes(make_pdf([["text"]]))
    monkeypatch.setitem(sys.modules, "pypdf", None)  # import pypdf -> ImportError
    with pytest.raises(CorpusError, match=r"a\.pdf: reading \.pdf files needs the pypdf package.*"
                                          r"pip install 'longdoc\[docs\]'"):
        list(read_documents([str(path)]))
    monkeypatch.setitem(sys.modules, "docx", None)
    skips = Skips()
    (tmp_path / "b.docx").write_bytes(b"PK")
    assert list(read_documents([str(tmp_path)], skips=skips)) == []
    assert skips.counts == {"missing library": 2}


def test_unknown_single_file_lists_the_supported_types(tmp_path):
    path = tmp_path / "sheet.xlsx"
    path.write_bytes(b"PK")
    with pytest.raises(CorpusError, match=r"unknown file type '\.xlsx'.*\.txt, \.md, \.pdf, \.docx, \.html, \.htm, "
                                          r"\.jsonl"):
        list(read_documents([str(path)]))
    with pytest.raises(CorpusError, match="no such file or folder"):  # a missing .pdf is a path, not a hub id
        list(read_documents([str(tmp_path / "missing.pdf")]))


def test_folder_reads_every_document_and_reports_the_rest(tmp_path):
    files = mixed_folder(tmp_path / "docs")
    (tmp_path / "docs" / ".DS_Store").write_bytes(b"\0\0")  # hidden: not a document, not reported
    (tmp_path / "docs" / "~$history.docx").write_bytes(b"lock")  # Word's lock file likewise
    with pytest.raises(CorpusError, match=r"scan\.png: unsupported file type '\.png' in a folder.*\.pdf.*--skip-bad"):
        list(read_documents([str(tmp_path / "docs")]))
    skips = Skips()
    docs = {d["doc_id"]: d for d in read_documents([str(tmp_path / "docs")], skips=skips)}
    assert sorted(docs) == ["contract.pdf", "history.docx", "lease.html", "notes.txt"]
    assert skips.counts == {"unsupported file type": 1} and str(files["png"]) in skips.summary()
    # the text matches the source text after whitespace normalisation
    assert _norm(docs["contract.pdf"]["text"]) == _norm(CONTRACT_TEXT)
    assert _norm(docs["history.docx"]["text"]) == _norm(" ".join(
        v if isinstance(v, str) else " ".join(c for row in v for c in row) for _, v in DOCX_BLOCKS))
    assert _norm(docs["lease.html"]["text"]) == _norm(HTML_TEXT)
    assert _norm(docs["notes.txt"]["text"]) == _norm(files["txt"].read_text(encoding="utf-8"))
    assert "pages" in docs["contract.pdf"] and "sections" in docs["lease.html"] and "pages" not in docs["notes.txt"]


def test_folder_of_only_unsupported_files(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    with pytest.raises(CorpusError, match=r"folder has no \.txt/\.md/\.pdf/\.docx/\.html/\.htm files "
                                          r"\(found extensions: \.png\)"):
        list(read_documents([str(tmp_path)]))


def test_data_file_inside_a_document_folder_says_pass_it_directly(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "rows.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(CorpusError, match=r"rows\.jsonl: unsupported file type '\.jsonl'.*pass data files directly"):
        list(read_documents([str(tmp_path)]))


def test_cli_prepare_on_a_mixed_folder(tmp_path, capsys):
    from longdoc.cli import main

    mixed_folder(tmp_path / "docs")
    common = ["data", "prepare", str(tmp_path / "docs"), "--target-tokens", "256", "--cache-dir",
              str(tmp_path / "cache")]
    assert main([*common, "--out", str(tmp_path / "a.jsonl")]) == 2
    assert "scan.png: unsupported file type '.png'" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "rows.parquet"), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "rows from 4 documents" in captured.out
    assert "skipped 1 bad item(s): 1 unsupported file type" in captured.err and "scan.png" in captured.err
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "rows.parquet"), split="train")
    assert sorted(d for ids in ds["doc_ids"] for d in ids) == ["contract.pdf", "history.docx", "lease.html",
                                                              "notes.txt"]


def test_every_skipped_file_is_named_not_just_the_first_few(tmp_path, capsys):
    from longdoc.cli import main

    mixed_folder(tmp_path / "docs")
    bad = [f"scan{i}.png" for i in range(7)]  # more than the summary line's first five
    for name in bad:
        (tmp_path / "docs" / name).write_bytes(b"x")
    assert main(["data", "prepare", str(tmp_path / "docs"), "--target-tokens", "256", "--cache-dir",
                 str(tmp_path / "cache"), "--out", str(tmp_path / "rows.jsonl"), "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert all(name in err for name in [*bad, "scan.png"]), err


def test_a_damaged_pdf_is_one_line_on_stderr_and_exit_2(tmp_path, capfd):
    """pypdf's own warnings on a damaged file ("EOF marker not found") stay quiet: the user sees our one line."""
    import logging

    from longdoc.cli import main

    path = tmp_path / "broken.pdf"
    path.write_bytes(b"%PDF-1.4\n1 0 obj garbage\n")
    assert main(["data", "prepare", str(path), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.pdf: not a readable PDF file" in err[0], err
    assert logging.getLogger("pypdf").level == logging.NOTSET  # put back as it was
