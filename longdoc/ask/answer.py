"""What every rank of `longdoc ask` runs: load the model, prefill the document once under CP, answer.

longdoc.ask.cli starts the ranks through longdoc.eval.runner; without --question they serve the interactive prompt
(longdoc.ask.console)."""

from __future__ import annotations

import time
from typing import Any

import torch

from longdoc.ask import console
from longdoc.eval import runner
from longdoc.eval.prompts import Prompter
from longdoc.hf.branches import greedy_each
from longdoc.hf.session import KVSession
from longdoc.parallel.api import ContextParallel


def answer_text(prompter: Prompter, ids: list[int]) -> str:
    """A generated answer as text: up to its first stop token (EOS, end of turn), stripped."""
    stops = set(prompter.stop_ids())
    cut = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return prompter.tok.decode(ids[:cut], skip_special_tokens=True).strip()


def job(cp: ContextParallel, device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    """The rank job: {"tokens", "seconds", "cp"} of the prefill, plus "answers" (one per --question). Without
    questions it serves the prompt until the user quits; rank 0 talks to it through cfg["relay"]."""
    relay = cfg.get("relay") if cp.rank == 0 else None
    if not cfg.get("question"):
        console.ignore_interrupts()  # Ctrl-C is the prompt's (it stops one answer), never a rank's
    model, tokenizer = runner.load_model(cfg["model"], cfg, device)
    prompter = Prompter(tokenizer, chat=cfg.get("chat"))
    ids, questions = cfg["prefix_ids"], cfg.get("question") or []
    suffixes = [prompter.suffix(q) for q in questions]
    asked = max(map(len, suffixes), default=0) + cfg["max_new_tokens"]
    runner.check_context(model, len(ids) + asked, f"the document's prompt of {len(ids)} tokens plus question and "
                                                  f"answer ({asked} more)")
    with KVSession(model, cp, strategy=cfg.get("strategy", "ring")) as session:
        started = time.perf_counter()
        session.prefill(torch.tensor([ids], device=device))
        info = {"tokens": len(ids), "seconds": time.perf_counter() - started, "cp": cp.size}
        if questions:
            generated = greedy_each(session, suffixes, cfg["max_new_tokens"], prompter.stop_ids(),
                                    batch=cfg.get("batch", 16))
            return {**info, "answers": [answer_text(prompter, g) for g in generated]}
        console.serve(session, prompter, relay, cfg, info)
    return info
