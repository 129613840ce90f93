"""What a fine-tune gained and what it cost, side by side: the held-out QA gain (`eval compare`) beside the no-harm
verdict (`eval guard`), as a few printed lines and one plot. `make demo` ends with it:

    python -m longdoc.eval.sidebyside runs/cpu-demo/compare runs/cpu-demo/guard --out runs/cpu-demo/outcome.png

The QA line gives the paired 95% bootstrap interval of the F1 difference; the guard line is the guard's own verdict
line (longdoc.eval.harm). Both read the run folders as written, so the plot shows what the reports say.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from longdoc.eval import report


def lines(qa: dict[str, Any], guard: dict[str, Any]) -> list[str]:
    f1, em = qa["overall"]["f1"], qa["overall"]["em"]
    p = qa["paired"]["f1"]
    gain = "a gain" if p["low"] > 0 else "within noise" if p["high"] >= 0 else "a LOSS"
    return [f"held-out QA: F1 {f1['a']:.3f} -> {f1['b']:.3f} ({p['delta']:+.3f}, 95% CI [{p['low']:+.3f}, "
            f"{p['high']:+.3f}], {gain}), EM {em['a']:.3f} -> {em['b']:.3f}, on {p['n']} questions",
            guard["line"]]


def figure(qa: dict[str, Any], guard: dict[str, Any]):
    """Two panels: held-out QA F1 by question kind (base vs tuned), and the guard's needle accuracy by length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = sorted(qa["by_kind"])
    x = range(len(kinds))
    for off, side, label in ((-0.2, "a", "base"), (0.2, "b", "tuned")):
        left.bar([i + off for i in x], [qa["by_kind"][k]["f1"][side] for k in kinds], width=0.4, label=label)
    left.set_xticks(list(x), kinds, rotation=30, ha="right")
    left.set_ylabel("F1")
    left.set_ylim(0, 1.15)  # room for the legend above the bars
    left.set_title(f"held-out QA: F1 {qa['overall']['f1']['a']:.2f} -> {qa['overall']['f1']['b']:.2f}")
    left.legend(loc="upper center", ncol=2)
    needle = guard["plot"]["needle"]
    labels = [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in needle["lengths"]]
    for off, side, label in ((-0.2, "a", "base"), (0.2, "b", "tuned")):
        right.bar([i + off for i in range(len(labels))], [v or 0 for v in needle[side]], width=0.4, label=label)
    right.set_xticks(range(len(labels)), labels)
    right.set_ylim(0, 1.15)
    right.set_xlabel("context length")
    right.set_ylabel("needle accuracy")
    right.set_title(f"no-harm check on held-out real text: {guard['verdict']}")
    right.legend(loc="upper center", ncol=2)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m longdoc.eval.sidebyside", description=__doc__.split("\n\n")[0])
    p.add_argument("compare", help="an `eval compare` folder with QA results")
    p.add_argument("guard", help="an `eval guard` folder")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--started", type=float, default=None, help="the run's start (seconds since the epoch): print the "
                                                                 "wall time and the CPU kind")
    args = p.parse_args(argv)
    try:
        qa = report.load_results(Path(args.compare))["qa"]
        guard = report.load_results(Path(args.guard))
    except (OSError, ValueError, KeyError) as e:
        print(f"sidebyside: cannot read the reports: {e}", file=sys.stderr)
        return 2
    for line in lines(qa, guard):
        print(line)
    report.save_figure(figure(qa, guard), args.out)
    print(f"plot: {args.out}")
    if args.started is not None:
        print(f"wall time {time.time() - args.started:.0f} s on {cpu_kind()}")
    return 0


def cpu_kind() -> str:
    """This CPU as the training precision sees it (`train.mixed_precision: auto`)."""
    from longdoc.train.modeling import cpu_bf16_flags

    flags = cpu_bf16_flags()
    return (f"a CPU with native bf16 ({', '.join(flags)}: training in bf16 autocast)" if flags
            else "a CPU without native bf16 (no avx512_bf16 / amx_bf16: training in fp32)")


if __name__ == "__main__":
    sys.exit(main())
