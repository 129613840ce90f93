"""Your own documents, end to end: the commands of docs/guides/your-documents.md, run in order as the guide writes
them. A folder of PDF, DOCX, HTML and text files -> continued pretraining with the no-harm mix -> (optionally) a
chat run -> base vs tuned on your own questions, the needle and the RULER-style suite with your documents as the
haystack -> preference pairs from your questions and DPO from the tuned model -> a question asked of the folder.
The guide is the one copy of the commands: this script reads them from it, sets the guide's variables (your files
from the arguments, the sizes from the guide's walk or smoke line), and prints each command first.

    python examples/your_documents.py my_contracts/ --questions my_questions.jsonl --chat my_chats.jsonl --out runs/mine
    python examples/your_documents.py my_contracts/ --questions my_questions.jsonl --out runs/mine --smoke

--questions: jsonl of {"document": ..., "qa": [{"question": ..., "answer": ...}]} (or flat {document, question,
answer} rows); --chat: jsonl of {"messages": [{"role", "content"}, ...]} conversations (OpenAI or ShareGPT); without
it the chat commands are left out. --smoke: the guide's smoke sizes (a tiny random model, a few minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "your-documents.md"
FILES = ("DOCS", "QUESTIONS", "CHATS", "OUT")  # the guide's variables for your files; the others are its sizes
_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_ASSIGN = re.compile(r"[A-Z_]+=\S*")


def bash_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def assignments(line: str) -> dict[str, str] | None:
    """`A=1 B=2  # comment` -> {A: 1, B: 2}; None for a line that is not only variable assignments."""
    words = shlex.split(line, comments=True)
    if not words or not all(_ASSIGN.fullmatch(w) for w in words):
        return None
    return dict(w.split("=", 1) for w in words)


def settings(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """The guide's variables at the walk's sizes and at its smoke sizes (the commented-out assignment line): the
    guide's first bash block."""
    walk: dict[str, str] = {}
    smoke: dict[str, str] = {}
    for line in bash_blocks(text)[0].splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#"):
            smoke.update(assignments(stripped.lstrip("#")) or {})
        else:
            walk.update(assignments(line) or {})
    if not walk or not smoke or set(smoke) - set(walk):
        raise SystemExit(f"{GUIDE}: its first bash block must set the variables, then a commented-out smoke line")
    return walk, {**walk, **smoke}


def commands(text: str) -> list[str]:
    """Every command of the guide's bash blocks after the first, as written (continuation lines kept)."""
    out = []
    for block in bash_blocks(text)[1:]:
        current = ""
        for line in block.splitlines():
            if not current and (not line.strip() or line.lstrip().startswith("#")):
                continue
            current += line + "\n"
            if not line.endswith("\\"):
                out.append(current.rstrip("\n"))
                current = ""
    return out


def run(command: str, env: dict[str, str]) -> None:
    """One command of the guide, printed as written; `longdoc` is this Python's (`python -m longdoc` in this
    checkout). Stops the walk at the first that fails."""
    print("$ " + command, flush=True)
    shim = f'longdoc() {{ {shlex.quote(sys.executable)} -m longdoc "$@"; }}\n'
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", shim + command], cwd=ROOT, env=env)
    if done.returncode:
        sys.exit(done.returncode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="your documents: a folder (or file) of .pdf/.docx/.html/.txt/.md or jsonl")
    p.add_argument("--questions", required=True, help="your questions about those documents (QA jsonl)")
    p.add_argument("--chat", default=None, help="your conversations (messages jsonl): adds the chat run")
    p.add_argument("--out", default="runs/your-documents", help="output folder (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="the guide's smoke sizes: a tiny random model, a few minutes")
    a = p.parse_args(argv)
    text = GUIDE.read_text(encoding="utf-8")
    walk, smoke = settings(text)
    mine = {"DOCS": a.folder, "QUESTIONS": a.questions, "CHATS": a.chat or "", "OUT": a.out}
    # absolute: the commands run from the repository root (they name recipes/*.yaml)
    env = {**os.environ, **(smoke if a.smoke else walk), **{k: str(Path(v).resolve()) for k, v in mine.items() if v}}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    for command in commands(text):
        if a.chat or "$CHATS" not in command:
            run(command, env)
    print(f"done: {env['OUT']}/compare (summary.md, plots); the tuned model: {env['OUT']}/pretrain/final; "
          f"preference-tuned: {env['OUT']}/dpo/final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
