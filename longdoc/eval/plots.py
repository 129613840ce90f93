"""Figures for evaluation reports. Each takes the JSON-ready data a report writes (never live objects),
so a figure redrawn from results.json is the figure in the folder.

Matplotlib runs headless (Agg); figures have a fixed size and layout, so cell positions are
reproducible (tests read pixel colors back from the PNG).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap, Normalize  # noqa: E402

# The red -> yellow -> green scale of the needle-in-a-haystack plots people know (Kamradt's LLMTest).
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
NEEDLE_NORM = Normalize(vmin=0.0, vmax=1.0)
_A, _B = "#4C72B0", "#DD8452"


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def needle_figure(data: dict[str, Any], title: str = "Needle in a haystack", ax=None):
    """Heatmap of data["accuracy"][depth][length]: depth on y (0% at the top), length on x."""
    grid = data["accuracy"]
    lengths, depths = data["lengths"], data["depths"]
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.4 + 1.1 * len(lengths), 1.6 + 0.55 * len(depths)), layout="constrained")
    values = [[float("nan") if v is None else v for v in row] for row in grid]
    im = ax.imshow(values, cmap=NEEDLE_CMAP, norm=NEEDLE_NORM, aspect="auto", interpolation="nearest")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="black")
    ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Needle depth")
    ax.set_title(title, fontsize=10)
    if fig is not None:
        fig.colorbar(im, ax=ax, label="accuracy", fraction=0.05)
        return fig
    return im


def position_figure(curves: Sequence[tuple[str, dict[str, Any]]], title: str = "Loss by position"):
    """Mean token loss per position bucket; one line per (label, data) with data["centers"], ["mean_loss"]."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for i, (label, data) in enumerate(curves):
        xs = [c for c, v in zip(data["centers"], data["mean_loss"]) if v is not None]
        ys = [v for v in data["mean_loss"] if v is not None]
        ax.plot(xs, ys, marker="o", markersize=3, label=label, color=(_A, _B, "#55A868", "#C44E52")[i % 4])
    ax.set_xlabel("Token position")
    ax.set_ylabel("Mean token loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(curves) > 1 or curves and curves[0][0]:
        ax.legend()
    return fig


def _bars(ax, groups: Sequence[str], series: Sequence[tuple[str, Sequence[float | None], str]], ylabel: str):
    width = 0.8 / max(len(series), 1)
    for k, (label, values, color) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=label, color=color)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)


def qa_figure(summary: dict[str, Any], title: str = "Document QA"):
    """EM and F1 by question kind, document length and evidence depth."""
    panels = [("by_kind", "question kind"), ("by_length", "document length"), ("by_depth", "evidence depth")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), layout="constrained",
                             gridspec_kw={"width_ratios": [max(len(summary[p]), 1) + 1 for p, _ in panels]})
    for ax, (key, label) in zip(axes, panels):
        groups = list(summary[key])
        _bars(ax, groups, [("EM", [summary[key][g].get("em") for g in groups], _A),
                           ("F1", [summary[key][g].get("f1") for g in groups], _B)], "score")
        ax.set_title(f"by {label}", fontsize=10)
    axes[0].legend()
    fig.suptitle(title, fontsize=11)
    return fig


def compare_qa_figure(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], metric: str = "f1"):
    """One metric of two QA summaries side by side, by kind, length and depth."""
    panels = [("by_kind", "question kind"), ("by_length", "document length"), ("by_depth", "evidence depth")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
    for ax, (key, label) in zip(axes, panels):
        groups = sorted(set(a[key]) | set(b[key]), key=lambda g: list(a[key]).index(g) if g in a[key] else 99)
        _bars(ax, groups, [(names[0], [a[key].get(g, {}).get(metric) for g in groups], _A),
                           (names[1], [b[key].get(g, {}).get(metric) for g in groups], _B)], metric.upper())
        ax.set_title(f"by {label}", fontsize=10)
    axes[0].legend()
    fig.suptitle(f"Document QA {metric.upper()}: {names[0]} vs {names[1]}", fontsize=11)
    return fig


def compare_needle_figure(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]):
    """The two needle heatmaps side by side on one color scale."""
    width = 2.0 + 1.1 * (len(a["lengths"]) + len(b["lengths"]))
    fig, axes = plt.subplots(1, 2, figsize=(width, 1.6 + 0.55 * max(len(a["depths"]), len(b["depths"]))),
                             layout="constrained")
    im = needle_figure(a, title=names[0], ax=axes[0])
    needle_figure(b, title=names[1], ax=axes[1])
    fig.colorbar(im, ax=axes, label="accuracy", fraction=0.04)
    return fig


def ruler_figure(data: dict[str, Any], title: str = "RULER-style suite", ax=None):
    """Heatmap of data["grid"][task][length] plus the average row: tasks on y, length on x (as the needle grid)."""
    rows = [*data["tasks"], "average"]
    values = [[float("nan") if v is None else v for v in row] for row in [*data["grid"], data["average"]]]
    lengths = data["lengths"]
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(2.6 + 1.1 * len(lengths), 1.4 + 0.42 * len(rows)), layout="constrained")
    im = ax.imshow(values, cmap=NEEDLE_CMAP, norm=NEEDLE_NORM, aspect="auto", interpolation="nearest")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="black",
                        fontweight="bold" if i == len(rows) - 1 else "normal")
    ax.axhline(len(rows) - 1.5, color="black", linewidth=1.0)
    ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("Context length (tokens)")
    ax.set_title(title, fontsize=10)
    if fig is not None:
        fig.colorbar(im, ax=ax, label="score", fraction=0.05)
        return fig
    return im


def compare_ruler_figure(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]):
    """The two RULER-style grids side by side on one color scale."""
    rows = max(len(a["tasks"]), len(b["tasks"])) + 1
    fig, axes = plt.subplots(1, 2, figsize=(5.0 + 1.1 * (len(a["lengths"]) + len(b["lengths"])), 1.4 + 0.42 * rows),
                             layout="constrained")
    im = ruler_figure(a, title=names[0], ax=axes[0])
    ruler_figure(b, title=names[1], ax=axes[1])
    fig.colorbar(im, ax=axes, label="score", fraction=0.04)
    return fig


def guard_figure(data: dict[str, Any], title: str = "No-harm check"):
    """`eval guard`: needle accuracy by length, loss by position and (when run) the RULER-style average by length,
    base and tuned in each panel. `data` is the guard's results.json "plot" entry."""
    names = data["names"]
    panels = ["needle", "position"] + (["ruler"] if data.get("ruler") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), layout="constrained")
    for ax, panel in zip(axes, panels):
        d = data[panel]
        xs = d["centers"] if panel == "position" else list(range(len(d["lengths"])))
        for side, name, color in (("a", names[0], _A), ("b", names[1], _B)):
            pts = [(x, y) for x, y in zip(xs, d[side]) if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=4, label=name, color=color,
                    linestyle="-" if side == "a" else "--")
        if panel == "position":
            ax.set_xlabel("Token position")
            ax.set_ylabel("Mean token loss (nats)")
            ax.set_title("Plain-text loss by position", fontsize=10)
        else:
            ax.set_xticks(xs, [_length_label(n) for n in d["lengths"]])
            ax.set_xlabel("Context length (tokens)")
            ax.set_ylabel("accuracy" if panel == "needle" else "score (average over tasks)")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title("Needle accuracy by length" if panel == "needle" else "RULER-style average", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig
