"""Loss by position: mean token loss in position buckets over long documents, and its curve.

    longdoc eval position-loss --model M --data legal.jsonl --length 4096 --buckets 16 --cp 2

The quickest evidence that far context helps: if the model uses it, the loss keeps falling with the
position; if it does not, the curve goes flat (or up, past the trained context). Each document is cut
to --length tokens (default: the shortest document's length; shorter ones are skipped, so every
bucket averages the same documents) and run in
one CP forward; each rank takes the cross-entropy of the tokens it holds (from the decoder's hidden states, a
chunk of tokens at a time: no rank ever holds its (local tokens x vocab) logits) and adds it to the bucket of
the predicted token's position, and one all-reduce of (documents x buckets x 2) numbers sums the ranks. Every
document's own bucket losses are kept too (`per_document`, keyed by a hash of its tokens), so two models' runs
over the same text pair document by document (`longdoc eval guard`).

With cfg["pack"] (set by `eval guard`, whose held-out text is often many short files) the documents are instead
joined in turn, a blank line between them, as the needle's --haystack joins them, and cut into at most
cfg["windows"] consecutive windows of --length tokens: short documents count too, and no window is skipped.
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import Any

import torch

from longdoc.corpus.ingest import Skips
from longdoc.eval import data, plots, report, runner
from longdoc.parallel import comm
from longdoc.parallel.api import ContextParallel


def _texts(cfg: dict[str, Any], tokenizer: Any) -> list[str]:
    if cfg.get("texts"):  # programmatic use: the documents themselves
        return list(cfg["texts"])
    if cfg.get("pl_data"):
        # Packed (eval guard): what --skip-bad leaves out the guard names; the needle reads the same files.
        skips = Skips() if cfg.get("pack") and cfg.get("skip_bad") else None
        return data.read_texts(cfg["pl_data"], cfg.get("limit_docs"), skips=skips)
    return data.synth_documents(cfg.get("domain", "legal"), int(cfg["length"] * 1.05) + 16, cfg.get("num_docs", 4),
                                cfg.get("seed", 0), tokenizer)


def pack(texts: list[str], length: int, windows: int, tokenizer: Any) -> list[list[int]]:
    """At most `windows` windows of `length` token ids cut in turn from `texts` joined by blank lines, each led by
    the tokenizer's BOS when it adds one (as a document tokenized alone is)."""
    probe = tokenizer("a", add_special_tokens=True, verbose=False)["input_ids"]
    head = probe[:1] if tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] else []
    sep = tokenizer("\n\n", add_special_tokens=False, verbose=False)["input_ids"]
    body, stream = length - len(head), list[int]()
    for text in texts:
        if len(stream) >= windows * body:
            break  # enough: the rest is never tokenized
        stream += (sep if stream else []) + tokenizer(text.strip(), add_special_tokens=False, verbose=False)[
            "input_ids"]
    if len(stream) < body:
        raise runner.EvalInputError(f"the text holds {len(stream)} tokens, fewer than one window of {length}; "
                                    f"pass more text or ask for shorter lengths")
    return [head + stream[k * body:(k + 1) * body] for k in range(min(windows, len(stream) // body))]


def _documents(cfg: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    texts = _texts(cfg, tokenizer)
    if cfg.get("pack"):
        return pack(texts, int(cfg["length"]), int(cfg.get("windows") or 16), tokenizer)
    return [tokenizer(t, add_special_tokens=True, verbose=False)["input_ids"] for t in texts]


def doc_key(ids: list[int]) -> str:
    """A short hash of a document's tokens: runs pair their documents by it (same text, same tokenizer)."""
    return hashlib.sha1(array("q", ids).tobytes()).hexdigest()[:16]


def token_losses(model: torch.nn.Module, cp: ContextParallel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, position) of this rank's predicted tokens for one sequence (1, n): loss[k] = -log p(token at
    position[k] | tokens before it), positions 1..n-1 spread over the ranks."""
    from longdoc.hf.prefill import label_losses

    losses, local = label_losses(model, cp, {"input_ids": ids, "labels": ids})
    targets, positions = local["shift_labels"][0], local["position_ids"][0]
    keep = torch.nonzero(targets != -100).flatten()
    return losses, positions[keep] + 1  # the loss at t predicts the token at t + 1


def evaluate(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """Bucketed mean loss, overall and per document (identical on every rank)."""
    from tqdm.auto import tqdm

    from longdoc.hf import is_patched, patch, unpatch

    buckets = int(cfg.get("buckets", 16))
    device = next(model.parameters()).device
    docs = _documents(cfg, tokenizer)
    length = int(cfg["length"]) if cfg.get("length") else min(len(d) for d in docs)
    if length < 2 * buckets:
        raise runner.EvalInputError(f"documents of {length} tokens are too short for {buckets} buckets; "
                                    f"lower --buckets")
    runner.check_context(model, length, f"position-loss over documents of {length} tokens (--length)")
    edges = torch.linspace(1, length, buckets + 1).round().long().tolist()  # predicted positions 1..length-1
    sums = torch.zeros(len(docs), buckets, 2, dtype=torch.float64, device=device)  # (doc, bucket, (loss sum, tokens))
    used: list[int] = []
    was_patched = is_patched(model)
    patch(model, cp, strategy=cfg.get("strategy", "ring"))
    try:
        for d, ids in enumerate(tqdm(docs, desc="position-loss", unit="doc", disable=cp.rank != 0,
                                     dynamic_ncols=True)):
            if len(ids) < length:
                continue
            with torch.no_grad():
                losses, pos = token_losses(model, cp, torch.tensor([ids[:length]], device=device))
            b = (torch.bucketize(pos, torch.tensor(edges[1:-1], device=pos.device), right=True)).to(device)
            sums[d, :, 0].index_add_(0, b, losses.double().to(device))
            sums[d, :, 1].index_add_(0, b, torch.ones_like(losses, dtype=torch.float64).to(device))
            used.append(d)
    finally:
        if not was_patched:
            unpatch(model)
    if cp.size > 1:
        comm.all_reduce(sums, cp.group, cp.timeout, cp.guard, "all_reduce position loss")
    if not used:
        raise runner.EvalInputError(f"no document has {length} tokens ({len(docs)} shorter ones skipped); lower "
                                    f"--length or pass longer documents")
    return _result(sums, used, docs, length, edges, cfg)


def _result(sums: torch.Tensor, used: list[int], docs: list[list[int]], length: int, edges: list[int],
            cfg: dict[str, Any]) -> dict[str, Any]:
    def mean(s: float, n: float) -> float | None:
        return float(s / n) if n else None

    total = sums[used].sum(dim=0)  # (buckets, 2)
    means = [mean(s, n) for s, n in total.tolist()]
    per_doc = {"keys": [doc_key(docs[d][:length]) for d in used],
               "loss": [mean(*sums[d].sum(dim=0).tolist()) for d in used],
               "bucket_loss": [[mean(s, n) for s, n in sums[d].tolist()] for d in used]}
    return {"task": "position-loss", "length": length, "buckets": len(edges) - 1, "documents": len(used),
            "skipped": len(docs) - len(used), "pack": bool(cfg.get("pack")), "edges": edges,
            "centers": [(lo + hi) / 2 for lo, hi in zip(edges[:-1], edges[1:])], "mean_loss": means,
            "tokens": [int(n) for _, n in total.tolist()], "overall": float(total[:, 0].sum() / total[:, 1].sum()),
            "first_bucket": means[0], "last_bucket": means[-1], "per_document": per_doc}


def task(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `longdoc eval position-loss` task (see longdoc.eval.runner)."""
    return evaluate(model, tokenizer, cp, cfg)


def check(cfg: dict[str, Any]) -> None:
    if not cfg.get("length") and not cfg.get("pl_data") and not cfg.get("texts"):
        raise ValueError("position-loss needs --data FILE.jsonl, or --length N to generate documents of N tokens")
    if not cfg.get("pl_data") and not cfg.get("texts") and cfg.get("domain", "legal") not in ("legal", "medical"):
        raise ValueError(f"position-loss generates legal or medical documents, not --domain {cfg['domain']}; pass "
                         f"--data (your own text)")
    if cfg.get("length") and int(cfg["length"]) < 2 * int(cfg.get("buckets", 16)):
        raise ValueError(f"--length ({cfg.get('length')}) must be at least twice --buckets ({cfg.get('buckets')})")
    skips = Skips() if cfg.get("pack") and cfg.get("skip_bad") else None
    data.check_inputs(cfg.get("pl_data") or [], "--data", skips=skips)


def write_report(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """results.json, position_loss.png (drawn from results.json as written) and summary.md."""
    run_dir = Path(run_dir)
    report.write_json(run_dir / report.RESULTS, results)
    w = report.load_results(run_dir)
    report.save_figure(plots.position_figure([(w["model"], w)], title=f"Loss by position: {w['model']}"),
                       run_dir / "position_loss.png")
    rows = [[f"{lo}-{hi - 1}", n, v] for lo, hi, n, v in zip(w["edges"][:-1], w["edges"][1:], w["tokens"],
                                                               w["mean_loss"])]
    drop = None if w["first_bucket"] is None or w["last_bucket"] is None else w["first_bucket"] - w["last_bucket"]
    md = [report.run_header("Loss by position", w),
          f"{w['documents']} document(s) of {w['length']} tokens ({w['skipped']} shorter skipped). Mean loss "
          f"{report.fmt(w['overall'])} nats; first bucket {report.fmt(w['first_bucket'])}, last "
          f"{report.fmt(w['last_bucket'])} (drop {report.fmt(drop)}).\n",
          report.table(["predicted positions", "tokens", "mean loss"], rows), "",
          "![loss by position](position_loss.png)"]
    report.write_text(run_dir / report.SUMMARY, "\n".join(md) + "\n")
    return run_dir

