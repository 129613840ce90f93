"""Office documents to plain text: PDF (pypdf), DOCX (python-docx), HTML (the standard library's parser).

    from longdoc.corpus.documents import read
    doc = read(Path("contract.pdf"))       # Document(text, pages=[[start, end), ...], sections=None)
    doc.text[slice(*doc.pages[2])]          # the third page's text

PDF and DOCX need the optional extra: `pip install 'longdoc[docs]'`. What each format gives:
- PDF: the text layer of every page (pypdf's plain extraction; its layout mode only pads columns with spaces
  on the PDFs measured), pages joined by a blank line, `pages` = each page's [start, end) in the text.
  A line that ends in "lowercase-" and whose next line starts in lowercase is joined ("pro-\\nvision" ->
  "provision"); a header or footer line (the first or last line of a page, digits ignored so page numbers
  match; a long line without letters is table data, never a footer) that repeats on >= 60% of the pages of a
  PDF of >= 3 pages with text is dropped. A PDF with no text on any page (a scan) is an error: OCR is out of
  scope.
- DOCX: body paragraphs and tables (cells joined by tabs) in document order; headings ("Heading N" styles
  level N, "Title" level 1) start `sections` = [{"title", "level", "start"}] (`start`: offset in the text).
- HTML: text outside script/style/head, whitespace collapsed as a browser does (kept in <pre>), block
  elements end lines, table cells joined by tabs; h1-h6 start `sections`.
Bad files raise `DocumentError` (problem, fix, reason); `longdoc.corpus.sources` adds where it is.
"""

from __future__ import annotations

import codecs
import importlib
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

SUFFIXES = (".pdf", ".docx", ".html", ".htm")
EXTRA = "pip install 'longdoc[docs]'"
MIN_PAGES, SHARE = 3, 0.6  # a header/footer is only recognised on >= 3 pages, repeating on >= 60% of them


class DocumentError(ValueError):
    """A file that cannot become a document; `reason` is the --skip-bad category."""

    def __init__(self, problem: str, fix: str = "", reason: str = "unreadable file"):
        super().__init__(problem + (f". {fix}" if fix else ""))
        self.problem, self.fix, self.reason = problem, fix, reason


@dataclass
class Document:
    text: str
    pages: list[list[int]] | None = None  # PDF: [start, end) of each page in `text`
    sections: list[dict[str, Any]] | None = None  # DOCX/HTML: {"title", "level", "start"} per heading

    def layout(self) -> dict[str, Any]:
        """The boundaries this format gives, as record fields."""
        return {k: v for k, v in (("pages", self.pages), ("sections", self.sections)) if v is not None}


def read(path: Path) -> Document:
    """The text (and page / section boundaries) of a .pdf, .docx, .html or .htm file."""
    suffix = path.suffix.lower()
    reader = {".pdf": read_pdf, ".docx": read_docx, ".html": read_html, ".htm": read_html}.get(suffix)
    if reader is None:
        raise DocumentError(f"not a document type ({suffix!r})", f"Supported: {', '.join(SUFFIXES)}",
                            reason="unsupported file type")
    doc = reader(path)
    if not doc.text.strip():
        raise DocumentError("the document has no text", "Remove the file or use --skip-bad", reason="empty document")
    return doc


def _library(module: str, package: str, suffix: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DocumentError(f"reading {suffix} files needs the {package} package, which is not installed",
                            f"Install the documents extra: {EXTRA}", reason="missing library") from None


def _unreadable(kind: str, e: Exception, fix: str) -> DocumentError:
    message = str(e).splitlines()[0] if str(e) else ""
    return DocumentError(f"not a readable {kind} file ({type(e).__name__}: {message})", fix)


# ---------------------------------------------------------------------------------------------- PDF
def read_pdf(path: Path) -> Document:
    pypdf = _library("pypdf", "pypdf", ".pdf")
    fix = "Check that it opens in a PDF viewer, or export it again"
    quiet = logging.getLogger("pypdf")  # its warnings on a damaged file ("EOF marker not found") would come before
    level, quiet.level = quiet.level, logging.ERROR  # our one line; what it cannot read raises, and is reported
    try:
        reader = pypdf.PdfReader(str(path))
        if reader.is_encrypted and not _decrypts(reader):
            raise DocumentError("the PDF is encrypted (password protected)",
                                "Save an unencrypted copy first (e.g. qpdf --decrypt in.pdf out.pdf)",
                                reason="encrypted PDF")
        pages = [page.extract_text() or "" for page in reader.pages]
    except DocumentError:
        raise
    except Exception as e:  # pypdf raises many types on damaged files; all mean "cannot read this one"
        raise _unreadable("PDF", e, fix) from None
    finally:
        quiet.setLevel(level)
    if not any(p.strip() for p in pages):
        raise DocumentError(f"no text layer on any of its {len(pages)} page(s): a scanned PDF? OCR is not "
                            "supported", "Run OCR first (e.g. ocrmypdf in.pdf out.pdf) and give the result",
                            reason="no text layer")
    # a soft hyphen only ever marks where a word may break: drop it, and the line break after it
    pages = [re.sub(r"[ \t]+\n", "\n", p.replace("\r\n", "\n").replace("\r", "\n")).replace("\u00ad\n", "")
             .replace("\u00ad", "") for p in pages]
    pages = [join_hyphens(p).strip() for p in drop_repeated_lines(pages)]
    text, spans = "", []
    for page in pages:
        if page:
            text += "\n\n" if text else ""
            spans.append([len(text), len(text) + len(page)])
            text += page
        else:  # a page without text (a figure, a scanned page): an empty range where it lies
            spans.append([len(text), len(text)])
    return Document(text, pages=spans)


def _decrypts(reader: Any) -> bool:
    try:
        return bool(reader.decrypt(""))  # many PDFs are "encrypted" with an empty user password
    except Exception:  # a missing crypto backend or an unknown algorithm: treat as locked
        return False


_HYPHEN = re.compile(r"(?<=(\w))-\n[ \t]*(?=(\w))")


def join_hyphens(text: str) -> str:
    """Join words hyphenated at a line end: only lowercase-hyphen-newline-lowercase, so "Smith-\\nJones",
    "pre-\\n2020" and a hyphen before a capital stay as they are."""
    return _HYPHEN.sub(lambda m: "" if m[1].islower() and m[2].islower() else m[0], text)


def _key(line: str) -> str:
    """The line with digits ignored (page numbers, dates), or "" for a line that cannot be a running header or
    footer: a long line without letters is a table row, not "- 12 -" or "12/40"."""
    key = re.sub(r"\d+", "#", " ".join(line.split()).lower())
    return key if len(key) <= 12 or any(ch.isalpha() for ch in key) else ""


def drop_repeated_lines(pages: list[str], min_pages: int = MIN_PAGES, share: float = SHARE) -> list[str]:
    """Pages without the running header and footer: the first (last) line of a page is dropped when that line,
    digits ignored, is the first (last) line of at least `share` of the pages with text, and there are at least
    `min_pages` of those. Two rounds per side, for two-line headers (a title, then a date)."""
    lines = [p.split("\n") for p in pages]
    with_text = sum(1 for p in pages if p.strip())
    if with_text < min_pages:
        return pages
    for side in (0, -1):
        for _ in range(2):
            edges = [_edge(ls, side) for ls in lines]
            keys = [_key(ls[i]) if i is not None else "" for ls, i in zip(lines, edges)]
            counts = Counter(k for k in keys if k)
            if not counts:
                break
            key, n = counts.most_common(1)[0]
            if n < max(2, share * with_text):
                break
            for ls, i, k in zip(lines, edges, keys):
                if k == key:
                    del ls[i]
    return ["\n".join(ls) for ls in lines]


def _edge(lines: list[str], side: int) -> int | None:
    """Index of the first (side 0) or last (side -1) non-blank line."""
    order = range(len(lines)) if side == 0 else range(len(lines) - 1, -1, -1)
    return next((i for i in order if lines[i].strip()), None)


# --------------------------------------------------------------------------------------------- DOCX
@dataclass
class _Builder:
    """Lines of text with headings marked: a heading opens a section and follows a blank line."""

    lines: list[str] = field(default_factory=list)
    sections: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0  # len("\n".join(lines))

    def line(self, text: str, heading: int = 0) -> None:
        text = text.strip("\n")
        if not text.strip():
            return
        if heading and self.lines:
            self._add("")
        if heading:
            self.sections.append({"title": " ".join(text.split()), "level": heading,
                                  "start": self.size + (1 if self.lines else 0)})
        self._add(text)

    def _add(self, text: str) -> None:
        self.size += len(text) + (1 if self.lines else 0)
        self.lines.append(text)

    def document(self) -> Document:
        return Document("\n".join(self.lines), sections=self.sections)


def read_docx(path: Path) -> Document:
    docx = _library("docx", "python-docx", ".docx")
    from docx.table import Table

    try:
        d = docx.Document(str(path))
        out = _Builder()
        for block in d.iter_inner_content():
            if isinstance(block, Table):
                _docx_table(block, out)
            else:
                out.line(block.text, heading=_heading_level(block))
    except Exception as e:  # python-docx raises zip, XML and key errors on damaged files
        raise _unreadable("DOCX", e, "Check that it opens in Word or LibreOffice; a .doc (Word 97-2003) file must "
                          "be saved as .docx first") from None
    return out.document()


def _heading_level(paragraph: Any) -> int:
    name = (getattr(paragraph.style, "name", "") or "").lower()
    if name == "title":
        return 1
    m = re.fullmatch(r"heading (\d)", name)
    return int(m[1]) if m else 0


def _docx_table(table: Any, out: _Builder) -> None:
    for row in table.rows:
        cells, seen = [], set()
        for cell in row.cells:  # a merged cell appears once per grid column it spans
            if id(cell._tc) in seen:
                continue
            seen.add(id(cell._tc))
            cells.append(" ".join(cell.text.split()))
        out.line("\t".join(c for c in cells if c))


# --------------------------------------------------------------------------------------------- HTML
_BLOCK = {"address", "article", "aside", "blockquote", "body", "br", "caption", "dd", "details", "dialog", "div",
          "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr", "html", "li", "main",
          "nav", "ol", "p", "pre", "section", "summary", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "ul"}
_SKIP = {"script", "style", "head", "noscript", "template", "svg", "math", "object", "iframe"}
_CELL = {"td", "th"}
_CELL_SEP = "\x1f"  # between table cells until a line is flushed (whitespace inside a cell collapses)
_VOID = {"br", "hr", "img", "input", "meta", "link", "wbr", "col", "area", "base", "embed", "source", "track"}


class _HTMLText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out, self.current, self.skip, self.pre, self.heading = _Builder(), "", 0, 0, 0

    def _flush(self) -> None:
        if self.pre:
            text = self.current.replace(_CELL_SEP, "\t")
        else:
            text = "\t".join(" ".join(c.split()) for c in self.current.split(_CELL_SEP) if c.strip())
        self.out.line(text, heading=self.heading)
        self.current = ""

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _SKIP:
            self.skip += 1
        elif self.skip:
            return
        elif re.fullmatch(r"h[1-6]", tag):
            self._flush()
            self.heading = int(tag[1])
        elif tag in _CELL and self.current.strip():
            self.current += _CELL_SEP  # cells of one row stay on one line, joined by tabs
        elif tag in _BLOCK:
            self._flush()
            self.pre += tag == "pre"

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        if not self.skip and tag in _BLOCK:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP:
            self.skip = max(0, self.skip - 1)
        elif self.skip or tag in _VOID or tag in _CELL:
            return
        elif re.fullmatch(r"h[1-6]", tag):
            self._flush()
            self.heading = 0
        elif tag in _BLOCK:
            self._flush()
            self.pre = max(0, self.pre - (tag == "pre"))

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        self.current += data


_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


def _html_text(data: bytes) -> str:
    if data.startswith(codecs.BOM_UTF8):
        return data[3:].decode("utf-8", errors="surrogateescape")
    m = _CHARSET.search(data[:4096])
    if m:
        try:
            encoding = codecs.lookup(m[1].decode("ascii")).name
        except LookupError:
            encoding = "utf-8"
        if encoding != "utf-8":
            return data.decode(encoding, errors="replace")
    text = data.decode("utf-8", errors="surrogateescape")
    if any("\udc80" <= ch <= "\udcff" for ch in text):
        raise DocumentError("invalid UTF-8 (and no <meta charset> names another encoding)",
                            "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or declare its charset",
                            reason="invalid UTF-8")
    return text


def read_html(path: Path) -> Document:
    parser = _HTMLText()
    parser.feed(_html_text(path.read_bytes()))
    parser.close()
    parser._flush()
    return parser.out.document()
