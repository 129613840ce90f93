"""Held-out chat loss: the mean loss per trained token of conversations (assistant turns by default), under CP.

    longdoc eval chat-loss --model runs/chat/final --data held-out-chats.jsonl --length 4096 --cp 2

The conversations (`messages` or ShareGPT `conversations`, as `longdoc data prepare --task chat` reads them)
become rows exactly as training prepares them (longdoc.corpus.chat: the model's chat template, the loss on the
assistant turns or every token, truncation to --length that never cuts a trained turn). Each row runs in one
CP forward; each rank takes the cross-entropy of the labelled tokens it holds (longdoc.hf.prefill.label_losses:
no rank holds its full logits) and one all-reduce sums the ranks. The mean is over tokens, as training's loss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longdoc.eval import data, report, runner
from longdoc.parallel import comm
from longdoc.parallel.api import ContextParallel


def _rows(cfg: dict[str, Any], tokenizer: Any) -> tuple[list[dict], list[str]]:
    """(rows, errors): rows of the conversations; errors of those that cannot fit --length."""
    from longdoc.corpus.chat import chat_row
    from longdoc.corpus.ingest import read_documents

    rows, errors = [], []
    for path in cfg["chat_data"]:
        for i, rec in enumerate(read_documents([path], task="chat")):
            if cfg.get("limit_docs") is not None and i >= cfg["limit_docs"]:
                break
            row = chat_row(tokenizer, rec["messages"], int(cfg.get("length") or 32768), cfg.get("loss_on", "assistant"),
                           cfg.get("truncation", "left"), rec["doc_id"], rec["source"])
            if row["error"]:
                errors.append(row["error"])
            else:
                rows.append(row)
    return rows, errors


def evaluate(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """Mean loss per labelled token over the conversations (identical on every rank)."""
    from tqdm.auto import tqdm

    from longdoc.hf import is_patched, patch, unpatch
    from longdoc.hf.prefill import label_losses

    rows, errors = _rows(cfg, tokenizer)
    if not rows:
        raise runner.EvalInputError(f"no conversation fits --length {cfg.get('length')}: {errors[:3]}")
    longest = max(len(r["input_ids"]) for r in rows)
    runner.check_context(model, longest, f"chat-loss over conversations of up to {longest} tokens (--length)")
    device = next(model.parameters()).device
    sums = torch.zeros(len(rows), 2, dtype=torch.float64, device=device)  # (loss sum, tokens) per conversation
    was_patched = is_patched(model)
    patch(model, cp, strategy=cfg.get("strategy", "ring"))
    try:
        for k, row in enumerate(tqdm(rows, desc="chat-loss", unit="conv", disable=cp.rank != 0, dynamic_ncols=True)):
            batch = {"input_ids": torch.tensor([row["input_ids"]], device=device),
                     "labels": torch.tensor([row["labels"]], device=device)}
            with torch.no_grad():
                losses, _ = label_losses(model, cp, batch)
            sums[k, 0], sums[k, 1] = losses.double().sum(), losses.numel()
    finally:
        if not was_patched:
            unpatch(model)
    if cp.size > 1:
        comm.all_reduce(sums, cp.group, cp.timeout, cp.guard, "all_reduce chat loss")
    tokens = int(sums[:, 1].sum())
    return {"task": "chat-loss", "loss_on": cfg.get("loss_on", "assistant"), "length": cfg.get("length"),
            "conversations": len(rows), "tokens": tokens, "overall": float(sums[:, 0].sum() / max(tokens, 1)),
            "per_conversation": [{"id": r["doc_ids"][0], "source": r["sources"][0], "tokens": int(n),
                                  "loss": float(s / n) if n else None, "cut": r["chat_parts"][0][4]}
                                 for r, (s, n) in zip(rows, sums.tolist())],
            "skipped": errors}


def task(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `longdoc eval chat-loss` task (see longdoc.eval.runner)."""
    return evaluate(model, tokenizer, cp, cfg)


def check(cfg: dict[str, Any]) -> None:
    if not cfg.get("chat_data"):
        raise ValueError("chat-loss needs --data FILE.jsonl of conversations (messages or ShareGPT conversations)")
    if cfg.get("length") is not None and int(cfg["length"]) < 16:
        raise ValueError(f"--length must be at least 16 tokens, got {cfg['length']}")
    data.check_inputs(cfg["chat_data"], "--data", task="chat")


def headline(results: dict[str, Any]) -> str:
    return report.headline({**results, "task": "chat-loss"})


def write_report(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """results.json and summary.md."""
    run_dir = Path(run_dir)
    report.write_json(run_dir / report.RESULTS, results)
    w = report.load_results(run_dir)
    rows = [[c["id"], c["tokens"], c["loss"], c["cut"]] for c in w["per_conversation"]]
    md = [report.run_header("Chat loss", w), headline(w) + ".\n",
          report.table(["conversation", "loss tokens", "mean loss", "tokens cut"], rows), ""]
    md += [f"- did not fit: {e}" for e in w.get("skipped", [])]
    return report.write_text(run_dir / "summary.md", "\n".join(md) + "\n")
