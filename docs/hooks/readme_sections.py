"""Cut an old-style (long) README's `##` sections into the docs pages they moved to, for merging README edits made
on other branches before the README was split:

    git show OTHER_BRANCH:README.md > /tmp/old.md
    python docs/hooks/readme_sections.py /tmp/old.md /tmp/pages   # then diff /tmp/pages with docs/

Headings are demoted one level, repo links become code spans (docs/ links become page-relative), the bench table
becomes the generated `<!-- docgen:performance -->` block. Hand edits made to the pages afterwards (the
performance prose, fixed links) are not reproduced: compare, do not overwrite.
"""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text()
OUT = Path(sys.argv[2])
# section title -> page (order kept inside a page)
PAGES = {
    "Quick start": "getting-started.md", "Set-up": "getting-started.md",
    "Context-parallel attention": "concepts.md",
    "Patching a Hugging Face model": "guides/patch.md",
    "Data": "guides/data.md",
    "Training": "guides/training.md",
    "Use longdoc from your own Trainer script": "guides/trainer.md",
    "Evaluation": "guides/evaluation.md",
    "Performance": "performance.md",
    "Planning": "guides/planning.md",
    "Reliability": "reliability.md",
    "Code layout": "development.md", "Tests": "development.md",
}
TITLES = {"getting-started.md": "Getting started", "concepts.md": "Concepts", "guides/patch.md": "Patch a model",
          "guides/data.md": "Data", "guides/training.md": "Training, recipes and accelerate configs",
          "guides/trainer.md": "Your own Trainer / SFTTrainer script", "guides/evaluation.md": "Evaluation",
          "performance.md": "Performance", "guides/planning.md": "Planning", "reliability.md": "Reliability",
          "development.md": "Development: code layout and tests"}
parts = re.split(r"^## (.+)$", text, flags=re.M)
intro, secs = parts[0], list(zip(parts[1::2], parts[2::2]))
out = {}
unknown = [t for t, _ in secs if t.strip() not in PAGES]
if unknown:
    sys.exit(f"unmapped sections: {unknown}")
def fix(body, page):
    depth = page.count("/")
    up = "../" * depth
    # repo links: docs/X -> relative to the page; other repo files -> code spans
    def link(m):
        label, target = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "#")):
            return m.group(0)
        if target.rstrip("/") == "docs/outcome":
            return f"[{label}]({up}outcome/summary.md)"
        if target.startswith("docs/"):
            return f"[{label}]({up}{target[5:]})"
        return f"{label} (`{target}`)"
    body = re.sub(r"(?<!!)\[([^\]]+)\]\(([^)]+)\)", link, body)
    # the bench table becomes the generated block (from docs/bench/*.json)
    body = re.sub(r"<!-- bench:start -->.*?<!-- bench:end -->", "<!-- docgen:performance -->", body, flags=re.S)
    body = re.sub(r"!\[([^\]]*)\]\(docs/([^)]+)\)", lambda m: f"![{m.group(1)}]({up}{m.group(2)})", body)
    # demote headings outside code fences
    lines, fenced = [], False
    for line in body.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"^#{3,6} ", line):
            line = line[1:]
        if not fenced and re.match(r"^      [^ ]", line):  # a code block inside a list item needs 8 spaces
            line = "  " + line
        lines.append(line)
    return "\n".join(lines)
for title, body in secs:
    page = PAGES[title.strip()]
    multi = list(PAGES.values()).count(page) > 1
    chunk = (f"## {title.strip()}\n" if multi else "") + fix(body, page).strip("\n") + "\n"
    out.setdefault(page, []).append(chunk)
for page, chunks in out.items():
    p = OUT / page
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"# {TITLES[page]}\n\n" + "\n".join(chunks))
    print(page, sum(c.count("\n") for c in chunks))
(OUT / "README-intro.md").write_text(intro)
