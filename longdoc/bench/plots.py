"""PNG plots of the benchmark sections (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from longdoc.bench.longest import FEATURES, MODELS


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def attention(result: dict, out: Path) -> Path:
    plt = _plt()
    lengths = result["lengths"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in result["runs"][0]["median_s"]:
        a.plot(lengths, [r["median_s"][key] for r in result["runs"]], marker="o", label=key)
    a.set(xscale="log", yscale="log", xlabel="tokens", ylabel="seconds (fwd+bwd)", title="causal attention time")
    a.legend(fontsize=8)
    for key, label in (("E", "E = SDPA / zigzag ring"), ("Z", "Z = contiguous / zigzag"),
                       ("ring_vs_allgather", "all-gather / ring"), ("E_ulysses", "E ulysses = SDPA / ulysses"),
                       ("E_usp", "E usp = SDPA / usp")):
        if key not in result["runs"][0]["ratios"]:
            continue
        b.plot(lengths, [r["ratios"][key] for r in result["runs"]], marker="o", label=label)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set(xscale="log", xlabel="tokens", ylabel="ratio", title="CP efficiency and layout gain")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    return _save(fig, out / "attention.png")


def throughput(rows: list[dict], out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['model']} {r['seq_len'] // 1024}k\ncp{r['cp']} x {r['threads_per_rank']} thr" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows],
           color=["tab:blue" if r["cp"] == 1 else "tab:orange" for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set(ylabel="tokens/s (steady-state steps)", title="training throughput at equal total cores")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "train_throughput.png")


def memory(result: dict, out: Path) -> Path:
    plt = _plt()
    rows = result["rows"]
    cps = [r["cp"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cps, [r["peak_gib"] for r in rows], marker="o", label="measured peak RSS per rank")
    ax.plot(cps, [r["predicted_gib"] for r in rows], marker="x", ls="--", label="planner")
    fixed = rows[0]["predicted_fixed_gib"]
    ideal = [fixed + (rows[0]["peak_gib"] - fixed) / cp for cp in cps]
    ax.plot(cps, ideal, color="gray", ls=":", label="state + runtime + (cp=1 rest) / cp")
    ax.set(xscale="log", xlabel="cp (ranks sharing one sequence)", ylabel="GiB per rank",
           title=f"peak memory vs cp at {rows[0]['seq_len']:,} tokens")
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "memory_vs_cp.png")


def longest_matrix(result: dict, out: Path) -> Path:
    """`longdoc bench longest`: per model, the planner's longest at full depth per cp and features (bars), each
    labelled with its reduced-depth probe's planner error (measured; hatched beyond the tolerance)."""
    plt = _plt()
    cfg, cells = result["config"], [r for r in result["cells"] if "planner" in r]
    features = [f for f in cfg["features"] if any(r["feature"] == f for r in cells)] or cfg["features"]
    fig, axes = plt.subplots(1, len(cfg["models"]), figsize=(4.5 * len(cfg["models"]), 4.2), squeeze=False)
    width = 0.8 / len(features)
    for ax, model in zip(axes[0], cfg["models"]):
        for j, feature in enumerate(features):
            for i, cp in enumerate(cfg["cps"]):
                r = next((r for r in cells if (r["model"], r["cp"], r["feature"]) == (model, cp, feature)), None)
                if r is None:
                    continue
                ok = r["status"] == "measured" and r["planner"]["within_tolerance"]
                x, y = i + (j - (len(features) - 1) / 2) * width, r["planner"]["longest_full_depth"] / 1024
                ax.bar(x, y, width=width, color=f"C{j}", hatch="" if ok else "//", edgecolor=None if ok else "black",
                       label=FEATURES[feature][0] if i == 0 else None)
                tag = f"{r['planner']['error']:+.0%}" if r["status"] == "measured" else r["status"]
                ax.annotate(tag, (x, y), ha="center", va="bottom", fontsize=6, rotation=90, xytext=(0, 2),
                            textcoords="offset points")
        ax.margins(y=0.15)
        ax.set_xticks(range(len(cfg["cps"])), [f"cp={cp}" for cp in cfg["cps"]])
        ax.set(ylabel="k tokens (planner, full depth)", title=MODELS[model][0].split(" (")[0])
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"longest sequence under {cfg['cap_gib']:g} GiB per process (planner, full depth); labels: the "
                 f"planner's error on a measured reduced-depth run (hatched beyond {result['tolerance']:.0%})",
                 fontsize=8)
    return _save(fig, out / "longest_matrix.png")


def calibration(rows: list[dict], out: Path, tolerance: float) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    meas = [r["measured_gib"] for r in rows]
    pred = [r["predicted_gib"] for r in rows]
    top = max(meas + pred) * 1.1
    ax.fill_between([0, top], [0, top * (1 - tolerance)], [0, top * (1 + tolerance)], color="tab:green", alpha=0.15,
                    label=f"within {tolerance:.0%}")
    ax.plot([0, top], [0, top], color="gray", lw=0.8)
    ax.scatter(meas, pred, zorder=3)
    for r in rows:
        ax.annotate(r["run"], (r["measured_gib"], r["predicted_gib"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured peak RSS per rank (GiB)", ylabel="planner (GiB)",
           title="planner vs measured, CPU runs")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return _save(fig, out / "calibration.png")


def kernels(result: dict, out: Path) -> Path:
    plt = _plt()
    rows = result["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lengths = sorted({r["seq_len"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        vals = [next((r["tflops"] for r in rows if r["seq_len"] == n and r["variant"] == v), 0.0) for n in lengths]
        ax.bar([i + j * width for i in range(len(lengths))], vals, width=width, label=v)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))], [f"{n // 1024}k" for n in lengths])
    ax.set(xlabel="tokens", ylabel="TFLOP/s", title=f"{result['device']}: block kernels vs one flash call")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "kernels.png")
