"""examples/your_documents.py (issue 30, part 4) end to end on files the tests build: a folder of PDF, DOCX, HTML and
text -> prepare -> continued pretraining with the no-harm mix at cp=2 -> a chat run -> base vs tuned on the user's
questions, the needle and the RULER-style suite with the folder as the haystack (tiny model, one step each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.document_files import CONTRACT_TEXT, mixed_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_your_documents_example_runs_on_a_mixed_folder(tmp_path):
    files = mixed_folder(tmp_path / "docs")
    files["png"].unlink()  # the folder report of unsupported files has its own tests
    (tmp_path / "docs" / "terms.txt").write_text("".join(  # enough text for a 1k-token needle haystack
        f"{i}. The Customer shall give written notice of any defect within {i + 5} days of delivery.\n"
        for i in range(120)))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"document": CONTRACT_TEXT, "qa": [
        {"question": "Where does the Supplier have its principal place of business?", "answer": "Leeds"},
        {"question": "How much notice does termination need?", "answer": "ninety days"}]}) + "\n")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"{CONTRACT_TEXT}\n\nWhere is the Supplier based?"},
        {"role": "assistant", "content": "In Leeds."}]}) + "\n" for _ in range(4)))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "examples/your_documents.py", str(tmp_path / "docs"), "--questions",
                           str(questions), "--chat", str(chats), "--model", "tiny:llama", "--out", str(out),
                           "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in ("data prepare", "train recipes/cpu-legal-mix.yaml", "train recipes/cpu-chat.yaml", "eval compare"):
        assert f"$ longdoc {step}" in done.stdout
    assert (out / "pretrain" / "final").is_dir() and (out / "chat" / "final").is_dir()
    summary = (out / "compare" / "summary.md").read_text()
    assert "qa" in summary.lower() and "needle" in summary.lower() and "ruler" in summary.lower()
