"""`longdoc eval guard BASE TUNED --text DIR`: did fine-tuning harm the base model on your own held-out text?

    longdoc eval guard SmolLM2-135M-Instruct runs/demo/final --text heldout_docs/ --cp 2
    longdoc eval guard runs/eval/guard-final-20260101-120000 runs/demo2/final --text heldout_docs/ --cp 2  # base reused

Run it before shipping a tuned model. Both models run on the user's own held-out plain text (--text: .txt/.md/
.pdf/.docx/.html files or a folder of them; any input `longdoc data prepare` reads), in one start of the CP ranks
(each model loaded once; longdoc.eval.tasks.run_suite):
  - needle (longdoc.eval.needle, its "general" set): a 5-digit value planted in the text over --lengths x --depths x
    --repeats, at least 20 cells by default (1k,2k x 0,0.25,0.5,0.75,1 x 2), scored on the greedy answer; the
    planted sentence rotates over ten sentences about everyday things (a combination, a locker number, a postcode,
    ...), so the default grid holds each at every length;
  - plain-text loss (longdoc.eval.position): the documents joined and cut into at most --windows windows of the
    longest length, the mean loss in --buckets position buckets of each window;
  - optionally a short RULER-style subset (--ruler-samples N per task and length; lengths of 1k or more).
longdoc.eval.harm pairs the two sides item by item (needle cell, window x bucket, ruler sample) into paired 95%
bootstrap intervals of tuned minus base (needle cells resampled by sentence: a harm that one sentence shows is
not yet a harm to retrieval), and decides: HARM when an interval lies entirely on the harmful side
beyond its tolerance - needle (and ruler) accuracy, the delta's upper bound < 0 and the drop > --needle-tolerance
(default 0.05 absolute); plain-text loss, the relative increase's lower bound > --loss-tolerance (default 0.02,
i.e. 2%) - and NO HARM otherwise.

Exit status 0: NO HARM; 1: HARM; 2: bad input, one line on stderr, found in this process before any rank starts
(a missing --text, one with no readable document, too little text for the longest length, a model that does not
resolve, a BASE run folder evaluated with other settings): the same line with --cp 2 as without.

--out (default runs/eval/guard-<tuned>-<time>) gets base/<task>/ and tuned/<task>/ (normal run folders, as `eval
compare` writes them), results.json (both sides' numbers, the intervals, the verdict), summary.md and guard.png;
the command prints the report's path and, last, the one verdict line. BASE may be a run folder instead of a
model: a previous guard's folder (its base/ is reused) or that base/ folder itself, so a base is evaluated once.
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path
from typing import Any

from longdoc.corpus.ingest import Skips
from longdoc.errors import EXIT_FAIL, EXIT_OK
from longdoc.eval import data, harm, plots, report, runner, tasks
from longdoc.eval.compare import find_runs

NAMES = ("base", "tuned")
MIN_CELLS = 20  # needle cells the default --repeats reaches: fewer give an interval too wide to judge
MAX_LENGTHS = 3  # a quick check before shipping; `eval needle` / `eval compare` run full grids
# The settings a reused BASE run must share with this guard (else its items do not pair, or not fairly).
_SAME = {"needle": ("lengths", "depths", "repeats", "seed", "max_new_tokens", "domain", "chat"),
         "position-loss": ("length", "buckets", "windows", "pack"),
         "ruler": ("lengths", "seed", "samples", "ruler_tasks", "chat")}
_SAME_ALL = ("text_sha1", "dtype", "rope_type", "rope_factor")
# The guard's own options, kept out of the tasks' settings: the base's results (and their content-cache key in
# run_suite) must not depend on which tuned model it is judged against, or on the tolerances.
_GUARD_ONLY = ("base", "tuned", "needle_tolerance", "loss_tolerance", "ruler_samples", "ruler_tasks", "windows",
               "buckets")
_FLAGS = {"text_sha1": "--text (its content)", "length": "--lengths (the longest)", "samples": "--ruler-samples",
          "max_new_tokens": "--max-new-tokens", "ruler_tasks": "--ruler-tasks", "rope_type": "--rope-type",
          "rope_factor": "--rope-factor", "pack": "guard's packed text"}


def _check_options(cfg: dict[str, Any]) -> None:
    lengths, depths = cfg.get("lengths") or [], cfg.get("depths") or []
    if not 1 <= len(lengths) <= MAX_LENGTHS or len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths: give 1 to {MAX_LENGTHS} different context lengths (e.g. 1k,2k), got "
                         f"{lengths}; for a full grid use `longdoc eval needle` or `eval compare`")
    if not depths or len(set(depths)) != len(depths):
        raise ValueError(f"--depths: one or more different depths in [0, 1] (e.g. 0,0.5,1), got {depths}")
    for flag, key, low in (("--repeats", "repeats", 1), ("--windows", "windows", 1), ("--buckets", "buckets", 1),
                           ("--ruler-samples", "ruler_samples", 1)):
        if cfg.get(key) is not None and int(cfg[key]) < low:
            raise ValueError(f"{flag} must be >= {low}, got {cfg[key]}")
    if max(lengths) < 2 * int(cfg["buckets"]):
        raise ValueError(f"--lengths {max(lengths)} is too short for --buckets {cfg['buckets']} (the plain-text "
                         f"windows need 2 tokens a bucket); lower --buckets")
    if not 0 <= cfg["needle_tolerance"] < 1:
        raise ValueError(f"--needle-tolerance is an absolute accuracy drop in [0, 1), got {cfg['needle_tolerance']}")
    if cfg["loss_tolerance"] < 0:
        raise ValueError(f"--loss-tolerance is a relative loss increase >= 0 (0.02 = 2%), got {cfg['loss_tolerance']}")


def plan(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[str]]:
    """(the settings every task shares, per-task overrides, the task names) for run_suite, from the guard's
    options (`cfg`, which keeps the guard's own: tolerances, the models)."""
    from longdoc.eval import needle

    _check_options(cfg)
    lengths, depths = list(cfg["lengths"]), list(cfg["depths"])
    repeats = int(cfg.get("repeats") or max(math.ceil(MIN_CELLS / (len(lengths) * len(depths))),
                                            math.ceil(len(needle.NEEDLES["general"]) / len(depths))))
    path = Path(str(cfg["text"])).expanduser()
    text = str(path.resolve()) if path.exists() else str(cfg["text"])  # as the runs' configs record it
    shared = {**{k: v for k, v in cfg.items() if k not in _GUARD_ONLY}, "task": "guard", "text": text,
              "haystack": [text], "domain": "general", "repeats": repeats}
    overrides = {"position-loss": {"pl_data": [text], "pack": True, "windows": int(cfg["windows"]),
                                   "length": max(lengths), "buckets": int(cfg["buckets"])},
                 "ruler": {"samples": cfg.get("ruler_samples"), "ruler_tasks": cfg.get("ruler_tasks") or "all"}}
    names = ["needle", "position-loss"] + (["ruler"] if cfg.get("ruler_samples") else [])
    return shared, overrides, names


def read_text(cfg: dict[str, Any], model: str | None) -> dict[str, Any]:
    """Read --text as the ranks will (--skip-bad alike), fingerprint it, and count its tokens with `model`'s
    tokenizer up to what the longest needle cell needs (needle.haystacks' rule: the longest length plus 64): too
    little text is found here, not on the ranks. `model` None (both sides reused): no count."""
    from longdoc import models

    path = cfg["text"]
    skips = Skips() if cfg.get("skip_bad") else None
    data.check_inputs([path], "--text", skips=skips)
    texts = [t for t in data.read_texts([path], skips=skips) if t.strip()]
    if not texts:
        raise ValueError(f"--text {path}: no text in it (every document is empty); give held-out plain text")
    if model is not None:
        tokenizer, need, have = models.load_tokenizer(model), max(cfg["lengths"]) + 64, 0
        for t in texts:
            have += len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"])
            if have >= need:
                break
        if have < need:
            raise ValueError(f"--text {path} holds {have} tokens, the longest --lengths {max(cfg['lengths'])} needs "
                             f"about {need}; pass more held-out text or lower --lengths")
    return {"path": path, "sha1": hashlib.sha1("\0".join(texts).encode("utf-8")).hexdigest(),
            "documents": len(texts),
            "skipped": data.skipped(skips, "--text") if skips is not None and skips.total else None}


def reused_runs(path: str) -> dict[str, Path] | None:
    """task -> run folder when BASE/TUNED is a run folder (a guard's folder: its base/), None for a model."""
    runs = find_runs(path)
    if runs is not None and set(runs) == {"guard"}:
        return find_runs(runs["guard"] / "base")
    return runs


def check_reused(side: str, runs: dict[str, Path], names: list[str], shared: dict[str, Any],
                 overrides: dict[str, dict[str, Any]]) -> None:
    """A reused run folder must hold every task this guard runs, evaluated with the same settings on the same text."""
    where = f"{side.upper()} run folder {Path(next(iter(runs.values()))).parent}"
    for t in names:
        if t not in runs:
            raise ValueError(f"{where} has no {t} run (it has {', '.join(sorted(runs))}); name the {side} model to "
                             f"evaluate it, or drop --ruler-samples")
        theirs, want = report.load_results(runs[t]).get("config", {}), {**shared, **overrides.get(t, {})}
        for key in (*_SAME_ALL, *_SAME[t]):
            a, b = theirs.get(key), want.get(key)
            if key == "dtype":
                a, b = runner.check_dtype(str(a)), runner.check_dtype(str(b))
            if a != b:
                raise ValueError(f"{where}: its {t} run used {_FLAGS.get(key, '--' + key.replace('_', '-'))} "
                                 f"{a!r}, this guard asks for {b!r}; pass the same, or name the {side} model to "
                                 f"evaluate it again")


def _check_models(to_run: list[tuple[str, str]], shared: dict[str, Any], overrides: dict[str, dict[str, Any]],
                  names: list[str]) -> None:
    """Each model to run resolves and the lengths fit its context, from its config alone (eval's check_model)."""
    for _, model in to_run:
        for t in names:
            runner.check_model({**shared, **overrides.get(t, {}), "model": model, "task": t})


def main(cfg: dict[str, Any]) -> int:
    """The `longdoc eval guard` command: its exit status (0 NO HARM, 1 HARM); bad input raises (exit 2)."""
    from longdoc.runtime.launch import launched_world

    shared, overrides, names = plan(cfg)
    reused = {n: reused_runs(cfg[n]) for n in NAMES}
    to_run = [(n, str(cfg[n])) for n in NAMES if reused[n] is None]
    _check_models(to_run, shared, overrides, names)
    text = read_text(shared, to_run[-1][1] if to_run else None)
    shared["text_sha1"] = text["sha1"]
    for n, runs in reused.items():
        if runs is not None:
            check_reused(n, runs, names, shared, overrides)
    out = Path(cfg.get("out") or report.default_run_dir("guard", str(cfg["tuned"])))
    done: dict[str, dict[str, Path]] = {}
    if to_run:
        ran = tasks.run_suite(to_run, names, shared, out, overrides)
        if ran is None:
            return EXIT_OK  # not rank 0: the folders and the verdict are written there
        done = ran
    if not launched_world().is_main:
        return EXIT_OK
    results = write_guard({n: reused[n] or done[n] for n in NAMES}, names, {**cfg, **shared}, text, out)
    for m in (text["skipped"] or {}).get("messages", []):  # --skip-bad: every file named, as `data prepare` does
        print(f"  --text: skipped {m}", file=sys.stderr)
    print(f"report: {out}")
    print(results["line"], flush=True)
    return EXIT_FAIL if results["verdict"] == "HARM" else EXIT_OK


def _plot_data(loaded: dict[str, tuple[dict, dict]]) -> dict[str, Any]:
    """What guard.png draws, kept in results.json (plots are drawn from the JSON as written)."""
    needle = loaded["needle"][0]

    def by_length(r: dict) -> list[float | None]:
        cells = [[c["correct"] for c in r["cells"] if c["length"] == n] for n in needle["lengths"]]
        return [sum(c) / len(c) if c else None for c in cells]

    a, b = loaded["position-loss"]
    out: dict[str, Any] = {"names": list(NAMES),
                           "needle": {"lengths": needle["lengths"], "a": by_length(needle),
                                      "b": by_length(loaded["needle"][1])},
                           "position": {"centers": a["centers"], "a": a["mean_loss"], "b": b["mean_loss"]}}
    if "ruler" in loaded:
        ra, rb = loaded["ruler"]
        out["ruler"] = {"lengths": ra["lengths"], "a": ra["average"], "b": rb["average"]}
    return out


def write_guard(sides: dict[str, dict[str, Path]], names: list[str], settings: dict[str, Any],
                text: dict[str, Any], out: Path) -> dict[str, Any]:
    """results.json, summary.md and guard.png in `out` (`settings`: the guard's options and the tasks' settings);
    returns the results."""
    loaded = {t: (report.load_results(sides["base"][t]), report.load_results(sides["tuned"][t])) for t in names}
    judged = harm.judge(loaded, settings["needle_tolerance"], settings["loss_tolerance"])
    kept = {k: settings.get(k) for k in ("lengths", "depths", "repeats", "seed", "max_new_tokens", "windows",
                                            "buckets", "ruler_samples", "needle_tolerance", "loss_tolerance")}
    results = {"task": "guard", "names": list(NAMES), "models": {n: loaded["needle"][i].get("model")
                                                                 for i, n in enumerate(NAMES)},
               "text": text, "settings": kept,
               "runs": {n: {t: str(p) for t, p in sides[n].items() if t in names} for n in NAMES},
               **judged, "plot": _plot_data(loaded)}
    report.write_json(out / report.RESULTS, results)
    written = report.load_results(out)
    report.save_figure(plots.guard_figure(written["plot"], title=f"No-harm check: {written['verdict']}"),
                       out / "guard.png")
    report.write_text(out / report.SUMMARY, summary(written))
    return written


def summary(results: dict[str, Any]) -> str:
    """summary.md: the models and the text, one row per metric (base, tuned, delta, interval, verdict), the line."""
    s, text = results["settings"], results["text"]
    rows = []
    for name, m in results["metrics"].items():
        loss = m["kind"] == "loss"
        pct = (lambda v: "-" if v is None else f"{v:+.1%}") if loss else (lambda v: "-" if v is None else f"{v:+.3f}")
        rule = (f"lower bound > +{m['tolerance']:.1%}" if loss
                else f"upper bound < 0 and drop > {m['tolerance']:.2f}")
        rows.append([harm.LABELS[name] + (" (nats/token)" if loss else " (accuracy)"), m["base"], m["tuned"],
                     pct(m["delta"]), f"[{pct(m['low'])}, {pct(m['high'])}]", m["n"], rule,
                     "**HARM**" if m["harm"] else "no harm"])
    cells = len(s["lengths"]) * len(s["depths"]) * s["repeats"]
    md = ["# No-harm check: base vs tuned\n",
          *(f"- {n}: `{results['models'][n]}` (runs in `{Path(results['runs'][n]['needle']).parent}`)"
            for n in NAMES),
          f"- held-out text: `{text['path']}`, {text['documents']} document(s), sha1 {text['sha1'][:12]}"
          + (f"; --skip-bad {text['skipped']['summary']}" if text.get("skipped") else ""),
          f"- needle: lengths {', '.join(map(str, s['lengths']))} x {len(s['depths'])} depths x {s['repeats']} "
          f"repeat(s) = {cells} paired cells; plain text: up to {s['windows']} windows of {max(s['lengths'])} "
          f"tokens x {s['buckets']} position buckets" + (f"; ruler: {s['ruler_samples']} samples per task and "
                                                        f"length" if s.get("ruler_samples") else ""), "",
          report.table(["metric", "base", "tuned", "delta (tuned - base)", "95% CI (paired bootstrap)", "pairs",
                        "harm when", "verdict"], rows), "",
          f"Rule: {results['rule']}.\n", "![no-harm check](guard.png)\n", f"**{results['line']}**"]
    return "\n".join(md) + "\n"
