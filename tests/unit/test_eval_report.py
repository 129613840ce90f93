"""Run folders: atomic JSON/markdown/PNG writes, and plots that show exactly what results.json holds."""

from __future__ import annotations

import json
import math

import matplotlib.image as mpimg
import numpy as np
import pytest

from longdoc.eval import needle, plots, position, qa, report


def _needle_results() -> dict:
    """A needle result with varied cell accuracies (4 repeats per cell), one cell with no data."""
    lengths, depths, repeats = [1024, 2048, 4096], [0.0, 0.5, 1.0], 4
    pattern = {(0, 0): 4, (0, 1): 3, (0, 2): 2, (1, 0): 1, (1, 1): 0, (1, 2): 4, (2, 0): 2, (2, 1): 4}
    cells, grid = [], [[None] * len(lengths) for _ in depths]
    for (i, j), hits in pattern.items():
        for r in range(repeats):
            cells.append({"length": lengths[j], "depth": depths[i], "repeat": r, "doc_tokens": lengths[j],
                          "actual_depth": depths[i], "prompt_tokens": lengths[j] + 60, "needle": "n",
                          "question": "q", "answer": "12345", "prediction": "12345" if r < hits else "no",
                          "correct": float(r < hits)})
        grid[i][j] = hits / repeats
    return {"task": "needle", "model": "test-model", "domain": "legal", "lengths": lengths, "depths": depths,
            "repeats": repeats, "seed": 0, "accuracy": grid, "cells": cells,
            "mean_accuracy": sum(c["correct"] for c in cells) / len(cells), "config": {"cp": 2}}


def test_needle_heatmap_png_shows_the_json(tmp_path):
    needle.write_report(tmp_path, _needle_results())
    data = json.loads((tmp_path / "results.json").read_text())
    # The JSON grid agrees with its own cells.
    for i, d in enumerate(data["depths"]):
        for j, n in enumerate(data["lengths"]):
            hits = [c["correct"] for c in data["cells"] if c["depth"] == d and c["length"] == n]
            assert data["accuracy"][i][j] == (sum(hits) / len(hits) if hits else None)
    # The figure drawn from the JSON: image array, annotations and axes are the JSON's.
    fig = plots.needle_figure(data)
    ax = fig.axes[0]
    arr = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    expected = np.array([[np.nan if v is None else v for v in row] for row in data["accuracy"]])
    np.testing.assert_array_equal(arr, expected)
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{v:.2f}" for row in data["accuracy"] for v in row
                                                            if v is not None)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "2k", "4k"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "50%", "100%"]  # depth on y ...
    fig.canvas.draw()
    assert ax.transData.transform((0, 0))[1] > ax.transData.transform((0, 2))[1]  # ... 0% at the top
    # The PNG in the folder: sample each cell (off its label) and check the color is the value's color.
    png = mpimg.imread(tmp_path / "needle.png")[..., :3]
    scale = png.shape[1] / fig.bbox.width  # saved at report dpi, drawn at figure dpi
    for i, row in enumerate(data["accuracy"]):
        for j, v in enumerate(row):
            x, y = ax.transData.transform((j - 0.35, i - 0.3))
            px = png[int(round(png.shape[0] - y * scale)), int(round(x * scale))]
            if v is None:
                assert np.allclose(px, 1.0, atol=0.02), f"empty cell ({i}, {j}) is not blank: {px}"
            else:
                want = np.array(plots.NEEDLE_CMAP(plots.NEEDLE_NORM(v))[:3])
                assert np.abs(px - want).max() < 0.03, f"cell ({i}, {j}) = {v}: pixel {px}, colormap {want}"
    md = (tmp_path / "summary.md").read_text()
    assert "| 50% | 0.25 | 0.00 | 1.00 |" in md and "| 100% | 0.50 | 1.00 | - |" in md


def test_writes_are_atomic_and_json_is_strict(tmp_path):
    report.write_json(tmp_path / "r.json", {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}})
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail) == \
        {"a": None, "b": [1.0, None], "c": {"d": 2}}

    def crash(tmp):
        open(tmp, "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        report.atomic_write(tmp_path / "r.json", crash)
    assert json.loads((tmp_path / "r.json").read_text())["c"] == {"d": 2}  # the old file survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left behind


def test_position_and_qa_reports_plot_their_json(tmp_path):
    res = {"task": "position-loss", "model": "m", "length": 64, "buckets": 4, "documents": 2, "skipped": 1,
           "edges": [1, 17, 33, 48, 64], "centers": [9.0, 25.0, 40.5, 56.0], "mean_loss": [3.0, 2.5, None, 2.0],
           "tokens": [32, 32, 0, 32], "overall": 2.5, "first_bucket": 3.0, "last_bucket": 2.0}
    position.write_report(tmp_path / "pl", res)
    data = report.load_results(tmp_path / "pl")
    line = plots.position_figure([("m", data)]).axes[0].lines[0]
    assert list(line.get_xdata()) == [9.0, 25.0, 56.0] and list(line.get_ydata()) == [3.0, 2.5, 2.0]
    assert (tmp_path / "pl" / "position_loss.png").stat().st_size > 1000

    rows = [{"doc_id": "d", "qa_id": f"q{i}", "domain": "legal", "kind": k, "template": None, "depth": dep,
             "doc_tokens": 2048, "prompt_tokens": 2100, "question": "?", "answer": "a", "aliases": [],
             "prediction": "a" if i % 2 else "b", "em": float(i % 2), "f1": float(i % 2), "contains": float(i % 2),
             "nll": 1.0, "answer_tokens": 1, "nll_per_token": 1.0, "tf_em": 1.0}
            for i, (k, dep) in enumerate([("lookup", 0.1), ("lookup", 0.9), ("count", 0.5)])]
    qa.write_report(tmp_path / "qa", {"task": "qa", "model": "m", "summary": qa.summarize(rows), "rows": rows})
    data = report.load_results(tmp_path / "qa")
    assert data["summary"]["by_kind"]["lookup"] == {"n": 2, "em": 0.5, "f1": 0.5, "contains": 0.5,
                                                    "nll_per_token": 1.0, "tf_em": 1.0}
    bars = plots.qa_figure(data["summary"]).axes[0].patches
    heights = [b.get_height() for b in bars]  # EM bars then F1 bars, kinds in summary order
    assert heights == [data["summary"]["by_kind"][k][m] for m in ("em", "f1") for k in data["summary"]["by_kind"]]
    assert not math.isnan(sum(heights))
