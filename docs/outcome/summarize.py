"""One markdown table row per `longdoc eval compare` folder: QA F1 with its paired interval, the needle grid's
accuracy with a paired bootstrap over its cells, and the plain-text loss (loss by position, overall) change.

    .venv/bin/python docs/outcome/summarize.py runs/exp/*/compare
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from longdoc.eval.compare import paired_bootstrap


def _cells(r: dict, side: str) -> dict:
    f = Path(r["runs"][side].get("needle", "-")) / "results.json"
    if not f.is_file():
        return {}
    return {(c["length"], c["depth"], c["repeat"]): float(c["correct"]) for c in json.loads(f.read_text())["cells"]}


def row(folder: Path) -> str:
    r = json.loads((folder / "results.json").read_text())
    out = [folder.parent.name]
    qa = r.get("qa")
    if qa:
        f1, p = qa["overall"]["f1"], qa["paired"]["f1"]
        out += [f"{f1['a']:.3f} -> {f1['b']:.3f}",
                f"{p['delta']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] (n={p['n']})"]
    ca, cb = _cells(r, "a"), _cells(r, "b")
    if ca and cb:
        keys = sorted(set(ca) & set(cb))
        p = paired_bootstrap([ca[k] for k in keys], [cb[k] for k in keys])
        out.append(f"{sum(ca[k] for k in keys) / len(keys):.2f} -> {sum(cb[k] for k in keys) / len(keys):.2f} "
                   f"[{p['low']:+.2f}, {p['high']:+.2f}]")
    pl = r.get("position-loss")
    if pl:
        la, lb = pl["overall"]["a"], pl["overall"]["b"]
        out.append(f"{la:.3f} -> {lb:.3f} ({100 * (lb / la - 1):+.1f}%)")
    return "| " + " | ".join(out) + " |"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(row(Path(arg)))
