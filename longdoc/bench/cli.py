"""`longdoc bench`: benchmarks measured side by side in one run (JSON, markdown, PNG plots).

    longdoc bench                                   # every section (make bench), results in runs/bench/
    longdoc bench attention --seq-len 16384         # one length: CP efficiency E and zigzag gain Z
    longdoc bench memory longest --quick            # some sections at smoke-test sizes
    longdoc bench --readme README.md                # also refresh the README's performance table

`longdoc plan` (the estimator these benchmarks calibrate) is its own verb: longdoc/plan/cli.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from longdoc import cliargs
from longdoc.bench.sections import SECTIONS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (markdown table + JSON + PNG plots)",
                       description="Benchmarks measured side by side in one run; results saved as JSON, markdown "
                                   "and PNG plots. Sections: " + ", ".join(SECTIONS) + " (gpu only with CUDA).")
    p.add_argument("sections", nargs="*", default=[], metavar="SECTION",
                   help=f"which sections (default: all): {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every code path")
    p.add_argument("--seq-len", type=cliargs.length, default=None,
                   help="attention at this one length only (prints E and Z); default: the sweep --lengths")
    p.add_argument("--lengths", default=None, help="attention sweep lengths, comma-separated (default 4096,8192,16384)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: same as --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2, help="CP ranks (1 thread each); the baseline gets as many threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap-gib", type=float, default=None, help="per-process memory cap of the 'longest' section")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md and the plots")
    p.add_argument("--readme", default=None, metavar="PATH",
                   help="replace the text between <!-- bench:start --> and <!-- bench:end --> in this file")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from longdoc.bench import suite

    sections = tuple(args.sections) or SECTIONS
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"longdoc bench: unknown section(s) {unknown}; choose among {', '.join(SECTIONS)}")
        return 2
    if sections == ("attention",) and args.seq_len:
        return _single_attention(args)
    cfg = suite.quick() if args.quick else suite.SuiteConfig()
    att = dataclasses.replace(cfg.attention, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                              head_dim=args.head_dim, ranks=args.ranks,
                              repeats=1 if args.quick else args.repeats)
    lengths = ([args.seq_len] if args.seq_len else [int(x) for x in args.lengths.split(",")] if args.lengths
               else list(cfg.attention_lengths))
    train = cfg.train if args.cap_gib is None else dataclasses.replace(cfg.train, cap_gib=args.cap_gib)
    cfg = dataclasses.replace(cfg, sections=sections, out=args.out, attention=att, attention_lengths=tuple(lengths),
                              train=train)
    result = suite.run(cfg)
    md = suite.to_markdown(result)
    print("\n" + md)
    print(f"\nsaved {args.out}/bench.json, bench.md and {len(result['plots'])} plot(s)")
    if args.readme:
        if not suite.update_readme(args.readme, md):
            print(f"longdoc bench: {args.readme} has no {suite.README_START} ... {suite.README_END} markers; "
                  f"add them where the table belongs")
            return 2
        print(f"updated the performance table in {args.readme}")
    return 0


def _single_attention(args: argparse.Namespace) -> int:
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
