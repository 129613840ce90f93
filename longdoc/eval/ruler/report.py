"""The RULER-style suite's run folder: results.json, summary.md and ruler.png (the task x length heatmap)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longdoc.eval import plots, report

ABOUT = {
    "niah_single": "one needle (a key and its 7-digit value) in the haystack; retrieve the value",
    "niah_multikey": "four needles with different keys; retrieve the value of one (three distractors)",
    "niah_multivalue": "four values under one key; retrieve all four",
    "niah_multiquery": "four keys asked at once; retrieve all four values",
    "vt": "variable tracking: 5 variables chained by assignment over noise; name every one holding the value",
    "cwe": "common-word extraction: the 10 words repeated most often in a numbered list",
    "fwe": "frequent-word extraction: the 3 most frequent made-up words of a zeta-distributed text",
    "qa": "QA over encyclopedia entries of one kind: one fact of one entry among distractor entries",
}
_METRIC = {"all": "fraction of the expected values in the answer", "part": "1 when the answer holds the expected value"}


def grid_table(data: dict[str, Any]) -> str:
    header = ["task \\ length"] + [str(n) for n in data["lengths"]] + ["mean"]
    rows = [[t, *row, _mean(row)] for t, row in zip(data["tasks"], data["grid"])]
    rows.append(["**average**", *data["average"], data["overall"]])
    return report.table(header, rows, digits=3)


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def write_report(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """results.json, ruler.png (drawn from results.json as written) and summary.md."""
    run_dir = Path(run_dir)
    report.write_json(run_dir / report.RESULTS, results)
    w = report.load_results(run_dir)
    report.save_figure(plots.ruler_figure(w, title=f"RULER-style suite: {w['model']}"), run_dir / "ruler.png")
    md = [report.run_header("RULER-style long-context suite", w),
          f"{w['samples']} samples per task and length (seed {w['seed']}, {w['haystack']} haystack for the needle "
          f"tasks, {'chat template' if w.get('chat') else 'plain-text prompt'}). A length counts the prompt and "
          "the answer budget. Scores in [0, 1]; how each task is built and scored: docs/ruler.md.\n",
          *([f"Input: --haystack {w['skipped']['summary']} (--skip-bad).\n"] if w.get("skipped") else []),
          grid_table(w), "", "![RULER-style suite](ruler.png)", "", "## Tasks\n",
          report.table(["task", "what it asks", "score", "answer budget (tokens)"],
                       [[t, ABOUT[t], _METRIC[w["metrics"][t]], w["max_new_tokens"][t]] for t in w["tasks"]]), "",
          "## Time per cell (seconds)\n",
          report.table(["task", *map(str, w["lengths"])],
                       [[t, *(w["cell_seconds"][t].get(str(n)) for n in w["lengths"])] for t in w["tasks"]], 0), "",
          "## Misses (first 2 per task)\n",
          report.table(["task", "length", "expected", "prediction"],
                       [[r["task"], r["length"], ", ".join(r["references"])[:60],
                         r["prediction"][:80].replace("|", "/").replace("\n", " ")]
                        for t in w["tasks"] for r in [x for x in w["rows"] if x["task"] == t and x["score"] < 1][:2]])]
    report.write_text(run_dir / report.SUMMARY, "\n".join(md) + "\n")
    return run_dir
