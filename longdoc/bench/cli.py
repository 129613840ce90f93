"""`longdoc bench`: benchmarks measured side by side in one run (JSON, markdown, PNG plots).

    longdoc bench                                   # every section (make bench), results in runs/bench/
    longdoc bench attention --seq-len 16384         # one length: CP efficiency E per strategy, zigzag gain Z
    longdoc bench hybrid --seq-len 16384            # a Mamba2 + attention model: E, memory, state vs ring bytes
    longdoc bench memory longest --quick            # some sections at smoke-test sizes
    longdoc bench dsa --seq-len 16384               # DSA: one process vs CP, vs dense causal (--ranks CP size)
    longdoc bench kinds --seq-len 8192              # per-rank activation bytes and RSS, cp=2 vs 1, per layer kind
    longdoc bench longest --cap-gib 4               # longest trainable sequence under 4 GiB per process: 135M full FT,
                                                    # LoRA and a hybrid x cp 1/2/4 x memory features (--resume goes on
                                                    # from a killed run's runs/bench/longest.jsonl)
    longdoc bench --publish docs/bench              # the full suite, then bench.json + plots into docs/bench, from
                                                    # which the docs' performance page and README numbers are made

`longdoc plan` (the estimator these benchmarks calibrate) is its own verb: longdoc/plan/cli.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from longdoc import cliargs
from longdoc.bench.sections import LONGEST_DEFAULT_FEATURES, LONGEST_FEATURES, LONGEST_MODELS, SECTIONS
from longdoc.plan.hardware import PRECISIONS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run benchmarks (markdown table + JSON + PNG plots)",
                       description="Benchmarks measured side by side in one run; results saved as JSON, markdown "
                                   "and PNG plots. Sections: " + ", ".join(SECTIONS) + " (gpu only with CUDA).")
    p.add_argument("sections", nargs="*", default=[], metavar="SECTION",
                   help=f"which sections (default: all): {', '.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every code path")
    p.add_argument("--seq-len", type=cliargs.length, default=None,
                   help="attention at this one length only (prints E and Z; default: the sweep --lengths); "
                        "the hybrid and dsa sections' length (default 16384), the kinds section's (default 8192)")
    p.add_argument("--lengths", default=None, help="attention sweep lengths, comma-separated (default 4096,8192,16384)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: same as --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ranks", type=int, default=2, help="CP ranks (1 thread each); the baseline gets as many threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="attention: the usp row's Ulysses group size (default: ranks / 2 from 4 ranks on; no usp "
                        "row at 2 ranks)")
    g = p.add_argument_group("the longest section", "the longest trainable sequence under a per-process memory cap "
                             "(longdoc.bench.longest): real training steps at reduced depth, measured peak RSS beside "
                             "the planner's, and the planner's longest at full depth")
    g.add_argument("--cap-gib", type=float, default=None, help="per-process memory cap (default 4)")
    g.add_argument("--cp", type=_sizes, default=None, help="CP sizes, comma-separated (default 1,2,4; --quick 2)")
    g.add_argument("--models", default=None, help=f"comma-separated, among {', '.join(LONGEST_MODELS)} (default: all)")
    g.add_argument("--features", default=None,
                   help=f"comma-separated, among {', '.join(LONGEST_FEATURES)} (default "
                        f"{','.join(LONGEST_DEFAULT_FEATURES)}; --quick all): offload moves nothing on a CPU")
    g.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the measured runs (default 1; the hybrid at least 2)")
    g.add_argument("--probe", type=cliargs.length, default=None,
                   help="tokens per rank of a measured run (default 8k; --quick 512), halved while the planner puts "
                        "it above 80%% of the cap")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="training precision (default: what training picks on this CPU, bf16 autocast where it has "
                        "native bf16)")
    g.add_argument("--resume", action="store_true",
                   help="measure only the cells missing from <--out>/longest.jsonl (a killed run's finished cells)")
    g.add_argument("--journal-only", action="store_true",
                   help="with --resume: measure nothing; the matrix of the cells already in the journal, the others "
                        "shown as not measured (one matrix from several partial runs)")
    p.add_argument("--index-topk", type=int, default=None, help="dsa: keys per query (default 2048; --quick 256)")
    p.add_argument("--out", default="runs/bench",
                   help="folder for bench.json, bench.md and the plots (and longest.json, longest.md and the cells' "
                        "journal longest.jsonl)")
    p.add_argument("--publish", default=None, metavar="DIR",
                   help="after a full run (every section, not --quick), copy bench.json and the plots into DIR "
                        "(docs/bench in a checkout: `make docs` renders the performance page from it and "
                        "`python docs/hooks/docgen.py refresh` refreshes the README's headline numbers)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from longdoc.bench import suite

    sections = tuple(args.sections) or SECTIONS
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"longdoc bench: unknown section(s) {unknown}; choose among {', '.join(SECTIONS)}")
        return 2
    if args.publish and (args.sections or args.quick):
        print("longdoc bench: --publish takes a full run (the published bench.json replaces the last one, whose "
              "every section the docs render): drop the SECTION arguments and --quick, or run without --publish "
              "(results in --out)")
        return 2
    if args.journal_only and not args.resume:
        print("longdoc bench: --journal-only assembles the longest matrix from <--out>/longest.jsonl: add --resume")
        return 2
    if sections == ("attention",) and args.seq_len:
        return _single_attention(args)
    cfg = suite.quick() if args.quick else suite.SuiteConfig()
    att = dataclasses.replace(cfg.attention, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                              head_dim=args.head_dim, ranks=args.ranks, ulysses_size=args.ulysses_size,
                              repeats=1 if args.quick else args.repeats)
    lengths = ([args.seq_len] if args.seq_len else [int(x) for x in args.lengths.split(",")] if args.lengths
               else list(cfg.attention_lengths))
    given = {"cap_gib": args.cap_gib, "layers": args.layers, "probe": args.probe, "precision": args.precision,
             "cps": args.cp, "models": args.models and _names(args.models),
             "features": args.features and _names(args.features)}
    long_cfg = dataclasses.replace(cfg.longest, **{k: v for k, v in given.items() if v is not None})
    hybrid = dataclasses.replace(cfg.hybrid, seq_len=args.seq_len or cfg.hybrid.seq_len, ranks=args.ranks,
                                 repeats=1 if args.quick else args.repeats)
    dsa_cfg = dataclasses.replace(cfg.dsa, ranks=args.ranks, repeats=1 if args.quick else args.repeats,
                                  **({"seq_len": args.seq_len} if args.seq_len else {}),
                                  **({"index_topk": args.index_topk} if args.index_topk else {}))
    kinds = dataclasses.replace(cfg.kinds, ranks=args.ranks, **({"seq_len": args.seq_len} if args.seq_len else {}))
    cfg = dataclasses.replace(cfg, sections=sections, out=args.out, attention=att, attention_lengths=tuple(lengths),
                              hybrid=hybrid, dsa=dsa_cfg, kinds=kinds, longest=long_cfg, resume=args.resume,
                              journal_only=args.journal_only)
    result = suite.run(cfg)
    md = suite.to_markdown(result)
    print("\n" + md)
    print(f"\nsaved {args.out}/bench.json, bench.md and {len(result['plots'])} plot(s)")
    if args.publish:
        files = suite.publish(result, args.publish)
        print(f"published {len(files)} file(s) into {args.publish}: `make docs` renders them; "
              f"`python docs/hooks/docgen.py refresh` refreshes the README's headline numbers")
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated CP sizes such as 1,2,4, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _single_attention(args: argparse.Namespace) -> int:
    from longdoc.bench import attention

    cfg = attention.AttentionBenchConfig(seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                         head_dim=args.head_dim, ranks=args.ranks, repeats=args.repeats,
                                         ulysses_size=args.ulysses_size)
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
