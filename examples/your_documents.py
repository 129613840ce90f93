"""Your own documents, end to end: a folder of PDF, DOCX, HTML and text files -> continued pretraining with the
no-harm mix -> (optionally) a chat run -> base vs tuned on your own questions, the needle and the RULER-style suite
with your documents as the haystack. Every step is one `longdoc` command, printed before it runs, so you can run
them by hand instead (docs/guides/your-documents.md walks through them).

    python examples/your_documents.py my_contracts/ --questions my_questions.jsonl --out runs/mine
    python examples/your_documents.py my_contracts/ --questions q.jsonl --chat my_chats.jsonl --out runs/mine
    python examples/your_documents.py FOLDER --questions Q --out OUT --quick   # a smoke run (the test suite's)

--questions: jsonl of {"document": ..., "qa": [{"question": ..., "answer": ...}]} (or flat {document, question,
answer} rows); --chat: jsonl of {"messages": [{"role", "content"}, ...]} conversations (OpenAI or ShareGPT).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> None:
    """One `longdoc` command, printed first; stops the walk-through at the first that fails."""
    print("$ longdoc " + shlex.join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "longdoc", *args], cwd=ROOT)
    if done.returncode:
        sys.exit(done.returncode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="your documents: a folder (or file) of .pdf/.docx/.html/.txt/.md or jsonl")
    p.add_argument("--questions", required=True, help="your questions about those documents (QA jsonl)")
    p.add_argument("--chat", default=None, help="your conversations (messages jsonl): adds a chat run")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the base model (default: %(default)s)")
    p.add_argument("--out", default="runs/your-documents", help="output folder (default: %(default)s)")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks (default: %(default)s)")
    p.add_argument("--seq-len", default="8k", help="training window in tokens (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny lengths, one step, one sample")
    a = p.parse_args(argv)
    out = Path(a.out)
    seq_len = "512" if a.quick else a.seq_len
    steps = ["train.steps=1", "optim.warmup_steps=0"] if a.quick else []
    lengths = "1k" if a.quick else "2k,4k"
    model = [f"model.name={a.model}"]

    # 1. The documents in: every file read or reported by name (--skip-bad: unreadable files are counted, not fatal).
    tokenizer = [] if a.model.startswith("tiny:") else ["--tokenizer", a.model]  # tiny models use the default's
    run(["data", "prepare", a.folder, "--task", "pretrain", *tokenizer, "--target-tokens", seq_len, "--skip-bad",
         "--out", str(out / "prepared")])
    # 2. Continued pretraining with the no-harm mix: the loss on your documents' tokens, and KL toward the frozen
    #    base on the same tokens, so the model learns your text without drifting from what it could do.
    run(["train", "recipes/cpu-legal-mix.yaml", f"output_dir={out / 'pretrain'}", f"cp_size={a.cp}", "overwrite=true",
         f"data.seq_len={seq_len}", "data.mix[0].source=documents", f"data.mix[0].path={out / 'prepared'}",
         "data.mix[0].document_loss_weight=0", "data.mix[0].questions_per_row=null", "data.mix[0].kl_weight=1.0",
         *model, *steps])
    # 3. A chat run on your conversations (the loss on the assistant turns only).
    if a.chat:
        run(["train", "recipes/cpu-chat.yaml", f"output_dir={out / 'chat'}", f"cp_size={a.cp}", "overwrite=true",
             f"data.path={a.chat}", f"data.seq_len={seq_len}", *model, *steps])
    # 4. Base vs tuned, held out and paired: your questions, the needle and the RULER-style suite, both with your
    #    documents as the haystack.
    ruler = ["--ruler-tasks", "niah_single,vt", "--samples", "1"] if a.quick else ["--samples", "50"]
    run(["eval", "compare", a.model, str(out / "pretrain" / "final"), "--names", "base", "tuned",
         "--tasks", "qa,needle,ruler", "--data", a.questions, "--haystack", a.folder, "--lengths", lengths,
         "--max-new-tokens", "24", *ruler, "--cp", str(a.cp), "--out", str(out / "compare")])
    print(f"done: {out / 'compare'} (summary.md, plots); the tuned model: {out / 'pretrain' / 'final'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
