"""The "your own documents" guide (docs/guides/your-documents.md, issue 30 part 4) runs as written.

examples/your_documents.py reads the guide's commands and runs them in order as written (the guide is their one
copy). Fast: every command of the guide, at the walk's sizes and at its smoke sizes, parses as a `longdoc` command
and its recipe overrides load (unknown keys, warmup beyond the steps and bad values are errors there); the README's
CLI lines too, among them its two own-documents lines, and those of the guides it points to for preference tuning
and asking (training, evaluation). Slow: the walk itself at the smoke sizes, in a fresh copy of the repository's
tracked files (what a clone of a commit of them holds: no runs/, caches or untracked files) on a folder of generated
PDF, DOCX, HTML and text: prepare, continued pretraining with the no-harm mix at cp=2, the chat length report and a
chat run, base vs tuned on the user's questions, the needle and the RULER-style suite, preference pairs from those
questions and DPO from the tuned model, and a question asked of the folder at cp=2."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.document_files import CONTRACT_TEXT, mixed_folder

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "your-documents.md"


def _example():
    spec = importlib.util.spec_from_file_location("your_documents", ROOT / "examples" / "your_documents.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _guide_commands(text: str) -> list[str]:
    """The guide's commands, read here apart from the example's reader: the lines of its bash blocks that start
    with `longdoc `, continuation lines joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    joined = "\n".join(blocks).replace("\\\n", "\\\x00")
    return [line.replace("\\\x00", "\\\n") for line in joined.splitlines() if line.startswith("longdoc ")]


def _check_parses(command: str) -> None:
    """`longdoc ARGS` parses; a train command's recipe and overrides load (as `longdoc train ... --print`)."""
    from longdoc.cli import build_parser
    from longdoc.eval.cli import config
    from longdoc.train.config import load_recipe

    words = shlex.split(command, comments=True)
    assert words[0] == "longdoc", command
    args = build_parser().parse_args(words[1:])
    if args.verb == "train":
        load_recipe(args.recipe, args.overrides)
    elif args.verb in ("eval", "ask"):  # ask takes eval's model options and their checks
        config(args)


def test_every_guide_and_readme_command_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes are named relative to the repository root
    example, text = _example(), GUIDE.read_text(encoding="utf-8")
    commands = example.commands(text)
    assert commands == _guide_commands(text) and len(commands) == 9
    walk, smoke = example.settings(text)
    assert walk["MODEL"] == "SmolLM2-135M-Instruct" and smoke["MODEL"].startswith("tiny:")
    for sizes in (walk, smoke):
        for command in commands:
            expanded = re.sub(r"\$(\w+)", lambda m, sizes=sizes: sizes[m.group(1)], command)
            _check_parses(expanded.replace("\\\n", " "))
    readme = _guide_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    own = [c for c in readme if "runs/mine" in c]
    assert len(own) == 2 and len(readme) >= 10, readme
    for command in readme:
        _check_parses(command)
    for guide in ("training.md", "evaluation.md"):  # preference tuning and `longdoc ask`, where the guide points
        linked = _guide_commands((GUIDE.parent / guide).read_text(encoding="utf-8"))
        assert linked, guide
        for command in linked:
            _check_parses(command)


def _user_files(root: Path) -> dict[str, Path]:
    # mixed_folder's PNG stays: the guide's prepare and compare both pass --skip-bad, so it is named and left out
    mixed_folder(root / "docs")
    (root / "docs" / "terms.txt").write_text("".join(  # enough text for a 1k-token needle haystack
        f"{i}. The Customer shall give written notice of any defect within {i + 5} days of delivery.\n"
        for i in range(120)))
    questions = root / "questions.jsonl"
    questions.write_text(json.dumps({"document": CONTRACT_TEXT, "qa": [
        {"question": "Where does the Supplier have its principal place of business?", "answer": "Leeds"},
        {"question": "How much notice does termination need?", "answer": "ninety days"}]}) + "\n")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"{CONTRACT_TEXT}\n\nWhere is the Supplier based?"},
        {"role": "assistant", "content": "In Leeds."}]}) + "\n" for _ in range(4)))
    return {"docs": root / "docs", "questions": questions, "chats": chats}


def _tracked_copy(dest: Path) -> Path:
    """The repository's tracked files as the working tree has them, copied to dest (a fresh clone's content when
    the tree is clean; CI runs on one)."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout: the walk runs on a copy of the repository's tracked files")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():  # not one deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow  # 9 commands, 3 trainings, the comparison and the ask at cp=2: 3 CPU-minutes, 7 on 2 busy cores
def test_the_guide_runs_as_written_in_a_fresh_copy(tmp_path):
    clone = _tracked_copy(tmp_path / "clone")
    mine, out = _user_files(tmp_path), tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(clone)}
    done = subprocess.run([sys.executable, str(clone / "examples" / "your_documents.py"), str(mine["docs"]),
                           "--questions", str(mine["questions"]), "--chat", str(mine["chats"]), "--out", str(out),
                           "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    guide = _guide_commands((clone / "docs" / "guides" / "your-documents.md").read_text(encoding="utf-8"))
    assert done.stdout.count("$ longdoc ") == len(guide) == 9, done.stdout
    for command in guide:
        assert f"$ {command}\n" in done.stdout, command
    assert (out / "pretrain" / "final").is_dir() and (out / "chat" / "final").is_dir() and (out / "chats").exists()
    summary = (out / "compare" / "summary.md").read_text()
    assert "qa" in summary.lower() and "needle" in summary.lower() and "ruler" in summary.lower()
    assert "scan.png" in summary and "scan.png" in done.stdout  # left out by --skip-bad, and named
    assert re.search(r"^made 2 pairs ", done.stdout, re.M), done.stdout  # both questions, each the other's rejected
    assert (out / "pairs.jsonl").is_file() and (out / "dpo" / "final").is_dir()
    ask = next(shlex.split(c) for c in guide if c.startswith("longdoc ask "))
    question = ask[ask.index("--question") + 1]
    assert f"Q: {question}\nA: " in done.stdout, done.stdout[-3000:]  # the answer: a tiny random model's words
    assert re.search(r"^prefill: [\d,]+ tokens in [\d.]+ s \(cp=2\)$", done.stderr, re.M), done.stderr[-3000:]
