"""Long-document QA: one CP prefill per document, then per question greedy generation (sharded KV cache)
and teacher-forced answer scoring; metrics as in SQuAD / LongBench, broken down by question kind,
document length, evidence depth and domain.

    longdoc eval qa --model SmolLM2-135M-Instruct --data legal.jsonl --cp 2
    longdoc eval qa --model M --data my_qa.jsonl --skip-bad     # leave out bad records / questions, report them

Records are `longdoc data synth` lines: {id, domain, num_tokens, document, qa: [{id, kind, question,
answer, aliases, depth, ...}]}; any jsonl with "document" (or "text") and "qa" works. Answers and evidence
are found in the document up to case and whitespace (hard-wrapped text); with --skip-bad a record or question
that cannot be used is left out and counted, and the run reports what it skipped (as `data prepare` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from longdoc.corpus.ingest import Skips, read_documents
from longdoc.eval import data, metrics, plots, report, runner
from longdoc.eval.prompts import Prompter
from longdoc.eval.scoring import AnswerScore, answer_score, score_logits
from longdoc.hf.branches import Branches
from longdoc.hf.session import KVSession
from longdoc.parallel.api import ContextParallel

_KEEP = ("domain", "num_tokens", "aliases", "depth", "template")


def read_records(path: str | Path, limit_docs: int | None = None, limit_questions: int | None = None,
                 skips: Skips | None = None) -> list[dict[str, Any]]:
    """QA records of one input, read by the reader `longdoc data prepare` uses (longdoc.corpus.ingest):
    {document, qa: [...]} records, flat {document, question, answer} records, in any format it reads.
    Bad input raises `CorpusError`, or with `skips` is left out and counted there."""
    out = []
    docs = read_documents([path], task="qa", keep=_KEEP, skips=skips)
    for rec in docs if limit_docs is None else itertools.islice(docs, limit_docs):
        # depth: the record's own, else where the answer's evidence starts (as prepare finds it)
        qas = [{**q, "id": q["qa_id"], "kind": q["kind"] or "-",
                "depth": q["depth"] if isinstance(q.get("depth"), (int, float))
                else q["spans"][0][0] / max(len(rec["document"]), 1)} for q in rec["qas"][:limit_questions]]
        out.append({**rec, "id": rec["doc_id"], "qa": qas})
    if not out:
        raise ValueError(f"{path} holds no QA records" + (f" ({skips.summary()})" if skips and skips.total else ""))
    return out


def _progress(total: int, cp: ContextParallel, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="q", disable=cp.rank != 0, dynamic_ncols=True)


def evaluate(model: torch.nn.Module, tokenizer: Any, records: Sequence[dict[str, Any]], cp: ContextParallel, *,
             max_new_tokens: int = 64, strategy: str = "ring", chat: bool | None = None,
             progress: bool = True, batch: int = 16) -> list[dict[str, Any]]:
    """Per-question rows (identical on every rank). All ranks call this with the same records. Up to `batch`
    questions of a document are decoded together over its one prefill (longdoc.hf.branches; 1, or a model
    whose layers cannot branch, decodes them one at a time): the same answers up to rounding."""
    prompter = Prompter(tokenizer, chat=chat)
    stops = prompter.stop_ids()
    device = next(model.parameters()).device
    prefixes = [prompter.prefix(rec["document"]) for rec in records]
    for rec, ids in zip(records, prefixes):  # all of them before any compute: a long one must not come last
        asked = max(len(prompter.suffix(qa["question"]))
                    + max(max_new_tokens, len(prompter.answer(str(qa["answer"])))) for qa in rec["qa"])
        runner.check_context(model, len(ids) + asked, f"document {rec['id']!r} ({rec.get('source', '?')}): its prompt "
                             f"of {len(ids)} tokens plus question and answer ({asked} more)")
    bar = None  # drawn once the first session stands: a model refused by name leaves no half-drawn bar behind
    rows: list[dict[str, Any]] = []
    try:
        for rec, ids in zip(records, prefixes):
            prefix = torch.tensor([ids], device=device)
            with KVSession(model, cp, strategy=strategy) as session:
                if progress and bar is None:
                    bar = _progress(sum(len(r["qa"]) for r in records), cp, "qa")
                session.prefill(prefix)
                together = batch > 1 and session.branch_problem() is None
                step = batch if together else max(len(rec["qa"]), 1)
                for start in range(0, len(rec["qa"]), step):
                    qas = rec["qa"][start:start + step]
                    answered = (_answer_together if together else _answer_in_turn)(session, prompter, qas,
                                                                                    max_new_tokens, stops)
                    for qa, (tokens, score, asked) in zip(qas, answered):
                        rows.append(_row(rec, qa, prompter.decode_answer(tokens), score, prefix.shape[1] + asked))
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(f1=f"{metrics.mean(r['f1'] for r in rows):.3f}")
    finally:
        if bar is not None:
            bar.close()
    return rows


def _answer_in_turn(session: KVSession, prompter: Prompter, qas: Sequence[dict[str, Any]], max_new_tokens: int,
                    stops: list[int]) -> list[tuple[list[int], AnswerScore, int]]:
    """(generated ids, answer score, question tokens) per question, one question at a time over the prefill."""
    device = next(session.model.parameters()).device
    start, out = session.mark(), []
    for qa in qas:
        suffix = torch.tensor([prompter.suffix(qa["question"])], device=device)
        logits = session.extend(suffix)[:, -1]
        asked = session.mark()
        gen = session.greedy(logits, max_new_tokens, eos_token_id=stops)
        session.rollback(asked)
        score = answer_score(session, logits, torch.tensor(prompter.answer(str(qa["answer"])), device=device))
        session.rollback(start)
        out.append((gen.tokens[0].tolist(), score, suffix.shape[1]))
    return out


def _answer_together(session: KVSession, prompter: Prompter, qas: Sequence[dict[str, Any]], max_new_tokens: int,
                     stops: list[int]) -> list[tuple[list[int], AnswerScore, int]]:
    """What _answer_in_turn returns, every question decoded as one row of a batch over the one prefill
    (longdoc.hf.branches): one forward per generated token for all of them instead of one per question."""
    suffixes = [prompter.suffix(qa["question"]) for qa in qas]
    answers = [prompter.answer(str(qa["answer"])) for qa in qas]
    if not all(answers):
        raise ValueError("the answer is empty after tokenization; cannot score it")
    with Branches(session, len(qas)) as branches:
        logits = branches.extend(suffixes)  # (rows, vocab) after each question
        asked = branches.mark()
        scored = branches.extend([a[:-1] for a in answers], keep_all=True)
        scores = [score_logits(torch.cat([logits[r:r + 1], s]), torch.tensor(a, device=logits.device))
                  for r, (s, a) in enumerate(zip(scored, answers))]
        branches.rollback(asked)
        generated = branches.greedy(logits, max_new_tokens, eos_token_id=stops)
    return [(g, sc, len(q)) for g, sc, q in zip(generated, scores, suffixes)]


def _row(rec: dict[str, Any], qa: dict[str, Any], prediction: str, score: AnswerScore, prompt_tokens: int
         ) -> dict[str, Any]:
    answer = str(qa["answer"])
    golds = [answer, *[str(a) for a in qa.get("aliases") or []]]
    return {
        "doc_id": rec["id"], "qa_id": qa.get("id"), "domain": rec.get("domain", "-"),
        "kind": qa.get("kind", "-"), "template": qa.get("template"), "depth": qa.get("depth"),
        "doc_tokens": rec.get("num_tokens"), "prompt_tokens": prompt_tokens,
        "question": qa["question"], "answer": answer, "aliases": golds[1:], "prediction": prediction,
        "em": metrics.exact_match(prediction, golds), "f1": metrics.token_f1(prediction, golds),
        "contains": metrics.contains_answer(prediction, golds),
        "nll": score.nll, "answer_tokens": score.tokens, "nll_per_token": score.mean_nll,
        "tf_em": float(score.argmax_match),
    }


def _length(row: dict[str, Any]) -> str:
    return metrics.length_bucket(int(row["doc_tokens"] or row["prompt_tokens"]))


def _depth(row: dict[str, Any]) -> str:
    return metrics.depth_bucket(float(row["depth"])) if row.get("depth") is not None else "-"


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Overall means and the breakdowns by kind, document length, evidence depth and domain."""
    return {
        "overall": metrics.summarize(rows),
        "by_kind": metrics.breakdown(rows, lambda r: r["kind"]),
        "by_length": metrics.breakdown(rows, _length),
        "by_depth": metrics.breakdown(rows, _depth),
        "by_domain": metrics.breakdown(rows, lambda r: r["domain"]),
        "by_domain_length": metrics.breakdown(rows, lambda r: f"{r['domain']} {_length(r)}"),
        "by_length_kind": metrics.breakdown(rows, lambda r: f"{_length(r)} {r['kind']}"),
    }


_COLUMNS = [("n", "n"), ("em", "EM"), ("f1", "F1"), ("contains", "contains"), ("nll_per_token", "NLL/token"),
            ("tf_em", "TF-EM")]


def breakdown_table(group: dict[str, dict[str, Any]], name: str) -> str:
    return report.table([name] + [c[1] for c in _COLUMNS], [[g] + [s.get(k) for k, _ in _COLUMNS]
                                                             for g, s in group.items()])


def write_report(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """results.json, summary.md and qa.png in `run_dir`; the plot is drawn from the file as written."""
    run_dir = Path(run_dir)
    report.write_json(run_dir / report.RESULTS, results)
    written = report.load_results(run_dir)
    report.save_figure(plots.qa_figure(written["summary"], title=f"Document QA: {written['model']}"),
                       run_dir / "qa.png")
    s = written["summary"]
    md = [report.run_header("Long-document QA", written),
          "EM / F1: SQuAD normalization (lowercase, no punctuation or articles); contains: the gold answer occurs "
          "in the prediction; NLL/token and TF-EM: teacher-forced answer negative log-likelihood and "
          "exact match by argmax.\n",
          *([f"Input: {written['skipped']['summary']} (--skip-bad).\n"] if written.get("skipped") else []),
          "## Overall\n", breakdown_table({"all": s["overall"]}, "questions"), "",
          "## By question kind\n", breakdown_table(s["by_kind"], "kind"), "",
          "## By document length\n", breakdown_table(s["by_length"], "length"), "",
          "## By evidence depth\n", breakdown_table(s["by_depth"], "depth"), "",
          "## By domain and length\n", breakdown_table(s["by_domain_length"], "domain, length"), "",
          "## By length and kind\n", breakdown_table(s["by_length_kind"], "length, kind"), "",
          "![QA](qa.png)", "", "## Examples\n", _examples(written["rows"])]
    report.write_text(run_dir / report.SUMMARY, "\n".join(md) + "\n")
    return run_dir


def _examples(rows: Iterable[dict[str, Any]], n: int = 12) -> str:
    picked = list(rows)[:n]
    return report.table(["kind", "question", "gold", "prediction", "F1"],
                        [[r["kind"], r["question"][:90], r["answer"][:40], r["prediction"][:60].replace("|", "/"),
                          r["f1"]] for r in picked], digits=2)


def task(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `longdoc eval qa` task (see longdoc.eval.runner)."""
    skips = Skips() if cfg.get("skip_bad") else None
    records = [r for path in cfg["data"]
               for r in read_records(path, cfg.get("limit_docs"), cfg.get("limit_questions"), skips)]
    rows = evaluate(model, tokenizer, records, cp, max_new_tokens=cfg.get("max_new_tokens", 64),
                    strategy=cfg.get("strategy", "ring"), chat=cfg.get("chat"), batch=cfg.get("qa_batch", 16))
    result = {"task": "qa", "data": [str(p) for p in cfg["data"]], "documents": len(records),
              "summary": summarize(rows), "rows": rows}
    if skips is not None:
        result["skipped"] = data.skipped(skips, "--data")
    return result


def check(cfg: dict[str, Any]) -> None:
    """Fail fast, before ranks start, on missing or malformed data files."""
    if not cfg.get("data"):
        raise ValueError("qa needs --data FILE.jsonl (make one with `longdoc data synth --domain legal ...`)")
    data.check_inputs(cfg["data"], "--data", task="qa", skips=Skips() if cfg.get("skip_bad") else None)
