"""`longdoc bench`: benchmarks whose ratios are measured side by side in one run."""

from __future__ import annotations

import argparse
import json
import os


def add_parser(sub: argparse._SubParsersAction) -> None:
    from longdoc.bench import plan_cli

    plan_cli.add_parser(sub)  # `longdoc plan` lives with the benchmarks that calibrate it
    p = sub.add_parser("bench", help="run benchmarks (markdown table + JSON)",
                       description="Benchmarks measured side by side in one run; results saved as JSON.")
    p.add_argument("section", nargs="?", default="attention", choices=["attention"],
                   help="which benchmark (default: attention)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: same as --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2, help="CP ranks (1 thread each); the baseline gets as many threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench", help="folder for the JSON and markdown results")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from longdoc.bench import attention

    cfg = attention.AttentionBenchConfig(seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                         head_dim=args.head_dim, ranks=args.ranks, repeats=args.repeats)
    result = attention.run(cfg)
    md = attention.to_markdown(result)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(md + "\n")
    print(f"\nsaved {args.out}/attention.json and attention.md")
    return 0
