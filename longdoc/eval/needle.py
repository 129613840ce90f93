"""Needle in a haystack: a planted fact at a chosen depth of generated legal / medical filler, and a question
about it, over a grid of context lengths x depths. Accuracy grid as JSON and a heatmap PNG.

    longdoc eval needle --model M --domain legal --lengths 1k,2k,4k --depths 0,0.25,0.5,0.75,1 --cp 2

The haystack is the user's own documents (`--haystack FILE|FOLDER`, joined in turn; with --skip-bad a file that
cannot be read is left out and named in the report, as `data prepare --skip-bad` does) or a `longdoc data
synth` document of the domain cut to the cell's length (its facts are
about the case, never about the needle). The needle is one sentence of the domain's set (NEEDLES; the sentences
rotate over depths, then repeats: `template`) with a fresh random 5-digit value per cell, placed at the sentence
boundary at or before the requested depth; the cell's "length" is the document's token count with the needle in
it (the prompt adds the instruction and the question; a longer question takes its extra tokens from the
haystack, so every prompt of a length has about one token count).
A cell is correct when the value appears, as a whole word, in the greedy answer.

Cells whose prompts have exactly the same token count (most of one length's cells) are
decoded together, `--needle-batch` rows (default 8) in one KV session: one (rows, len) prefill and one batched
greedy decode, so each generated token is one forward for all of them instead of one per cell. A group holds at
most GROUP_TOKENS prompt tokens (rows x length; e.g. 8 rows at 4k, 4 at 8k, 1 at 32k and beyond), which bounds
the prefill's activations. The answers are those of one cell at a time (`--needle-batch 1`) up to rounding.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from longdoc.corpus.ingest import Skips
from longdoc.eval import data, metrics, plots, report, runner
from longdoc.eval.prompts import Prompter
from longdoc.hf.session import KVSession
from longdoc.parallel.api import ContextParallel

NEEDLES = {
    "legal": [("The combination of the evidence safe in the clerk's office is {value}.",
               "What is the combination of the evidence safe in the clerk's office?"),
              ("The parking permit number issued to the court reporter is {value}.",
               "What is the parking permit number issued to the court reporter?")],
    "medical": [("The access code for the patient's records cabinet is {value}.",
                 "What is the access code for the patient's records cabinet?"),
                ("The locker number assigned to the patient's belongings is {value}.",
                 "What is the locker number assigned to the patient's belongings?")],
    # Everyday facts for any text (the guard's set, `--domain general`: needs --haystack, the user's own text).
    # Ten sentences, so that a verdict rests on the skill of finding a stated fact, not on how one sentence reads:
    # half name a number, half a code, combination or id. Fixed before any tuned model was judged with them
    # (docs/outcome/experiments.md, "The guard's needles"); no word is shared with `longdoc data plant`'s.
    "general": [("The combination of the evidence safe in the clerk's office is {value}.",
                 "What is the combination of the evidence safe in the clerk's office?"),
                ("The parking permit number issued to the court reporter is {value}.",
                 "What is the parking permit number issued to the court reporter?"),
                ("The access code for the patient's records cabinet is {value}.",
                 "What is the access code for the patient's records cabinet?"),
                ("The locker number assigned to the patient's belongings is {value}.",
                 "What is the locker number assigned to the patient's belongings?"),
                ("The membership ID of the chess club's treasurer is {value}.",
                 "What is the membership ID of the chess club's treasurer?"),
                ("The tail number painted on the old seaplane is {value}.",
                 "What is the tail number painted on the old seaplane?"),
                ("The postcode of the lighthouse keeper's cottage is {value}.",
                 "What is the postcode of the lighthouse keeper's cottage?"),
                ("The jersey number worn by the goalkeeper is {value}.",
                 "What is the jersey number worn by the goalkeeper?"),
                ("The catalogue number of the missing museum painting is {value}.",
                 "What is the catalogue number of the missing museum painting?"),
                ("The voucher code printed on the bakery receipt is {value}.",
                 "What is the voucher code printed on the bakery receipt?")],
}
SYNTH_DOMAINS = ("legal", "medical")  # the domains `longdoc data synth` writes haystacks for


def template(cfg: dict[str, Any], j: int, i: int, r: int) -> int:
    """The needle sentence of cell (length j, depth i, repeat r). Within a length the cells c = r * len(depths) + i
    take the sentences in turn, so every run of len(set) cells holds each once; each further length and each
    further run of len(set) cells shifts the turn (by 1 and 2), so one sentence meets other depths there, never
    one depth only (a sentence that a model misreads at some depths must not hide at a depth it reads)."""
    size = len(NEEDLES[cfg["domain"]])
    c = r * len(cfg["depths"]) + i
    return (c + j + 2 * (c // size)) % size


def haystacks(domain: str, tokens: int, count: int, seed: int, tokenizer: Any,
              documents: list[str] | None = None) -> list[str]:
    """`count` filler documents of at least `tokens` tokens: generated (deterministic in domain, tokens, seed),
    or the user's `documents` (e.g. their own contracts) joined in turn, haystack r starting at document r."""
    if not documents:
        return data.synth_documents(domain, int(tokens * 1.05) + 64, count, seed, tokenizer)
    sizes = [len(tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"]) for d in documents]
    if sum(sizes) < tokens + 64:
        raise runner.EvalInputError(f"--haystack documents hold {sum(sizes)} tokens in all, the longest --lengths "
                                    f"cell needs about {tokens + 64}; pass more (or longer) documents or lower "
                                    f"--lengths")
    out = []
    for r in range(count):
        parts, have, i = [], 0, r % len(documents)
        while have < tokens + 64:
            parts.append(documents[i].strip())
            have += sizes[i] + 2
            i = (i + 1) % len(documents)
        out.append("\n\n".join(parts))
    return out


def plant(haystack: str, needle: str, length: int, depth: float, tokenizer: Any) -> tuple[str, float, int]:
    """The haystack cut so that haystack + needle is about `length` tokens, with the needle at the sentence
    boundary at or before `depth`; returns (document, actual depth in tokens, document tokens)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depths must be in [0, 1], got {depth}")
    enc = tokenizer(haystack, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    offsets = enc["offset_mapping"]
    room = length - len(tokenizer(" " + needle, add_special_tokens=False)["input_ids"]) - 1
    if room < 1 or room > len(offsets):
        raise ValueError(f"cannot fit a {length}-token context from a {len(offsets)}-token haystack")
    text = haystack[: offsets[room - 1][1]]
    if depth >= 1.0:
        pos, doc = len(text), text + "\n" + needle
    else:
        c = offsets[min(int(round(depth * room)), room - 1)][0] if depth > 0 else 0
        # The sentence boundary at or before c: right after a newline, or after ". ".
        newline, stop = text.rfind("\n", 0, c), text.rfind(". ", 0, c)
        pos = max(newline + 1 if newline >= 0 else 0, stop + 2 if stop >= 0 else 0)
        sep = "\n" if pos == 0 or text[pos - 1] == "\n" else " "
        doc = text[:pos] + needle + sep + text[pos:]
    n_doc = len(tokenizer(doc, add_special_tokens=False)["input_ids"])
    before = len(tokenizer(doc[:pos], add_special_tokens=False)["input_ids"]) if pos else 0
    return doc, before / max(n_doc, 1), n_doc


def _cells(cfg: dict[str, Any]) -> list[tuple[int, int, float, int]]:
    return [(j, i, d, r) for j, _ in enumerate(cfg["lengths"]) for i, d in enumerate(cfg["depths"])
            for r in range(cfg.get("repeats", 1))]


GROUP_TOKENS = 32768  # prompt tokens (rows x length) in one batched prefill: 8 x 4k; bounds its activations
DEFAULT_BATCH = 8


def groups(sizes: list[int], batch: int = DEFAULT_BATCH) -> list[list[int]]:
    """Indices of the prompts decoded together, given each prompt's token count: equal counts only (a KV session
    holds one length), at most `batch` rows and GROUP_TOKENS tokens a group (always at least one row), each group
    in prompt order, groups in the order of their first prompt."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--needle-batch must be an integer >= 1 (1 = one cell at a time), got {batch!r}")
    by_size: dict[int, list[int]] = {}
    for k, n in enumerate(sizes):
        by_size.setdefault(n, []).append(k)
    out = []
    for n, members in by_size.items():
        rows = max(1, min(batch, GROUP_TOKENS // max(n, 1)))
        out += [members[s:s + rows] for s in range(0, len(members), rows)]
    return sorted(out, key=lambda g: g[0])


def prompts(model: torch.nn.Module, tokenizer: Any, cfg: dict[str, Any], prompter: Prompter,
            stacks: list[str]) -> list[dict[str, Any]]:
    """Every cell's prompt, in grid order, built and checked against the model's context before any compute."""
    domain, lengths, seed = cfg["domain"], cfg["lengths"], cfg.get("seed", 0)
    new = cfg.get("max_new_tokens", 32)
    # A longer question takes its extra tokens from the haystack: every cell of a length then has (about) one
    # prompt length, and cells are decoded in batches of equal lengths (`groups`) whatever their sentence.
    asked = [len(prompter.suffix(q)) for _, q in NEEDLES[domain]]
    out = []
    for j, i, depth, r in _cells(cfg):
        length = lengths[j]
        rng = random.Random(f"needle:{domain}:{seed}:{length}:{depth}:{r}")
        value = str(rng.randrange(10000, 100000))
        t = template(cfg, j, i, r)
        sentence, question = NEEDLES[domain][t]
        needle = sentence.format(value=value)
        doc, actual, n_doc = plant(stacks[r], needle, length - (asked[t] - min(asked)), depth, tokenizer)
        ids = prompter.prefix(doc) + prompter.suffix(question)
        runner.check_context(model, len(ids) + new, f"the needle prompt for --lengths {length} ({len(ids)} tokens "
                                                    f"plus {new} new)")
        out.append({"j": j, "i": i, "depth": depth, "repeat": r, "template": t, "value": value, "needle": needle,
                    "question": question, "actual": actual, "doc_tokens": n_doc, "ids": ids})
    return out


def _decode(model: torch.nn.Module, cp: ContextParallel, rows: list[list[int]], cfg: dict[str, Any],
            stops: list[int]) -> list[list[int]]:
    """Greedy tokens of equal-length prompts, one KV session: prefill (rows, len), then one batched decode."""
    device = next(model.parameters()).device
    ids = torch.tensor(rows, device=device)  # (rows, len)
    with KVSession(model, cp, strategy=cfg.get("strategy", "ring")) as session:
        gen = session.greedy(session.prefill(ids), cfg.get("max_new_tokens", 32), eos_token_id=stops)
    return gen.tokens.tolist()  # a row that stopped early repeats its stop token: decode_answer cuts there


def evaluate(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The accuracy grid (identical on every rank)."""
    from tqdm.auto import tqdm

    domain, lengths, depths, repeats = cfg["domain"], cfg["lengths"], cfg["depths"], cfg.get("repeats", 1)
    seed = cfg.get("seed", 0)
    prompter = Prompter(tokenizer, chat=cfg.get("chat"))
    stops = prompter.stop_ids()
    skips = Skips() if cfg.get("haystack") and cfg.get("skip_bad") else None
    own = data.read_texts(cfg["haystack"], skips=skips) if cfg.get("haystack") else None
    stacks = haystacks(domain, max(lengths), repeats, seed, tokenizer, own)
    todo = prompts(model, tokenizer, cfg, prompter, stacks)
    tokens: list[list[int] | None] = [None] * len(todo)
    with tqdm(total=len(todo), desc="needle", unit="cell", disable=cp.rank != 0, dynamic_ncols=True) as bar:
        for group in groups([len(p["ids"]) for p in todo], cfg.get("needle_batch", DEFAULT_BATCH)):
            for k, row in zip(group, _decode(model, cp, [todo[k]["ids"] for k in group], cfg, stops)):
                tokens[k] = row
            bar.update(len(group))
    hits = [[[] for _ in lengths] for _ in depths]
    cells = []
    for p, gen in zip(todo, tokens):  # grid order, as decoded one cell at a time
        prediction = prompter.decode_answer(gen)
        correct = metrics.contains_answer(prediction, p["value"])
        hits[p["i"]][p["j"]].append(correct)
        cells.append({"length": lengths[p["j"]], "depth": p["depth"], "repeat": p["repeat"], "template": p["template"],
                      "doc_tokens": p["doc_tokens"], "actual_depth": p["actual"], "prompt_tokens": len(p["ids"]),
                      "needle": p["needle"], "question": p["question"], "answer": p["value"],
                      "prediction": prediction, "correct": correct})
    accuracy = [[metrics.mean(h) for h in row] for row in hits]
    result = {"task": "needle", "domain": domain, "lengths": list(lengths), "depths": list(depths),
              "repeats": repeats, "seed": seed, "accuracy": accuracy,
              "mean_accuracy": metrics.mean(c["correct"] for c in cells), "cells": cells}
    if skips is not None:
        result["skipped"] = data.skipped(skips, "--haystack")
    return result


def task(model: torch.nn.Module, tokenizer: Any, cp: ContextParallel, cfg: dict[str, Any]) -> dict[str, Any]:
    """The `longdoc eval needle` task (see longdoc.eval.runner)."""
    return evaluate(model, tokenizer, cp, cfg)


def check(cfg: dict[str, Any]) -> None:
    if cfg.get("domain") not in NEEDLES:
        raise ValueError(f"--domain must be one of {', '.join(NEEDLES)}, got {cfg.get('domain')!r}")
    if cfg["domain"] not in SYNTH_DOMAINS and not cfg.get("haystack"):
        raise ValueError(f"--domain {cfg['domain']} has no generated haystack: pass --haystack FILE|FOLDER (your own "
                         f"text), or use --domain {' or '.join(SYNTH_DOMAINS)}")
    if not cfg.get("lengths") or min(cfg["lengths"]) < 64:
        raise ValueError(f"--lengths must be token counts >= 64, got {cfg.get('lengths')}")
    if not cfg.get("depths") or any(not 0 <= d <= 1 for d in cfg["depths"]):
        raise ValueError(f"--depths must be fractions in [0, 1] (0 = start, 1 = end), got {cfg.get('depths')}")
    if cfg.get("repeats", 1) < 1:
        raise ValueError(f"--repeats must be >= 1, got {cfg['repeats']}")
    groups([], cfg.get("needle_batch", DEFAULT_BATCH))  # --needle-batch >= 1, before any rank starts
    data.check_inputs(cfg.get("haystack") or [], "--haystack", skips=Skips() if cfg.get("skip_bad") else None)


def grid_table(data: dict[str, Any]) -> str:
    header = ["depth \\ length"] + [str(n) for n in data["lengths"]]
    rows = [[f"{100 * d:.0f}%"] + list(row) for d, row in zip(data["depths"], data["accuracy"])]
    return report.table(header, rows, digits=2)


def write_report(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """results.json, needle.png (drawn from results.json as written) and summary.md."""
    run_dir = Path(run_dir)
    report.write_json(run_dir / report.RESULTS, results)
    written = report.load_results(run_dir)
    title = f"Needle in a haystack ({written['domain']}): {written['model']}"
    report.save_figure(plots.needle_figure(written, title=title), run_dir / "needle.png")
    misses = [c for c in written["cells"] if not c["correct"]][:10]
    md = [report.run_header(f"Needle in a haystack ({written['domain']})", written),
          f"Mean accuracy: **{report.fmt(written['mean_accuracy'], 3)}** over {len(written['cells'])} cells "
          f"({written['repeats']} needle(s) per cell). Rows: needle depth (0% = start of the document); "
          "columns: context length in tokens.\n",
          *([f"Input: --haystack {written['skipped']['summary']} (--skip-bad).\n"] if written.get("skipped") else []),
          grid_table(written), "", "![needle](needle.png)", "",
          "## Misses (first 10)\n",
          report.table(["length", "depth", "answer", "prediction"],
                       [[c["length"], f"{100 * c['actual_depth']:.0f}%", c["answer"],
                         c["prediction"][:70].replace("|", "/")] for c in misses])]
    report.write_text(run_dir / report.SUMMARY, "\n".join(md) + "\n")
    return run_dir
