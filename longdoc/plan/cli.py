"""`longdoc plan`: per-GPU memory and step time of a long-context fine-tuning run, before running it.

    longdoc plan --model Llama-3.1-8B --seq-len 131072 --gpus 8 --gpu h100
    longdoc plan --model SmolLM2-135M-Instruct --seq-len 32768 --gpus 2 --gpu cpu --memory-gib 8
    longdoc plan --model SmolLM2-135M-Instruct --seq-len 32768 --gpus 2 --gpu cpu --precision fp32

Formulas: longdoc/plan/memory.py and timing.py (README "Planning" works an example by hand).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from longdoc import cliargs


def add_parser(sub: argparse._SubParsersAction) -> None:
    from longdoc.plan.hardware import DEVICES, INTERCONNECTS

    p = sub.add_parser("plan", help="will a run fit? per-GPU memory, step time, recommended cp/dp/strategy",
                       description="Estimate per-GPU peak memory (term by term) and step time of every cp/dp/strategy "
                                   "the options leave open, recommend one, and say what to change if none fits. "
                                   "Needs only a config (no weights).")
    p.add_argument("--model", required=True,
                   help="published config name (Llama-3.1-8B, Llama-3.1-70B, Qwen2.5-7B, SmolLM2-135M), a config.json, "
                        "a model folder, 'tiny:<arch>' or a hub id")
    p.add_argument("--seq-len", type=cliargs.length, required=True,
                   help="tokens per training sequence (e.g. 131072, 128k, 1M)")
    p.add_argument("--gpus", type=int, default=8, help="devices in the job (= dp x cp)")
    p.add_argument("--gpu", default="h100", choices=list(DEVICES), help="device kind ('cpu': one local gloo process)")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16"),
                   help="compute precision of a CPU plan (default: what training picks here, train.mixed_precision "
                        "auto: bf16 autocast on CPUs with native bf16, else fp32); GPU plans are bf16")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory per device, overriding the device's (cpu: this machine's RAM / --gpus)")
    p.add_argument("--interconnect", default="nvlink", choices=list(INTERCONNECTS),
                   help="link between the GPUs of a node (groups larger than a node use InfiniBand)")
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on q/k/v/o, frozen bf16 base (no FSDP)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="full activation checkpointing on/off (default: consider both)")
    p.add_argument("--cp", type=int, default=None, help="pin the context-parallel size")
    p.add_argument("--dp", type=int, default=None, help="pin the data-parallel size")
    # validated by PlanRequest (longdoc.parallel.api.check_strategy): the choices live in the CP core, and
    # importing it here would import torch on every `longdoc --help`
    p.add_argument("--strategy", default=None,
                   help="pin the CP attention strategy: ring, allgather, ulysses or usp (default: consider all four)")
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="with --strategy usp: ranks per Ulysses group (default: every divisor 1 < U < cp)")
    p.add_argument("--no-chunked-loss", action="store_true",
                   help="cross-entropy over all local tokens at once (what most trainers do) instead of 1024 at a time")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="tokens per cross-entropy chunk (default: sized from the vocabulary as training does, so "
                        "the chunk's fp32 buffers stay under 256 MiB)")
    p.add_argument("--loss-tokens", type=int, default=None,
                   help="tokens per sequence that carry a label (default: all, as in pretraining; a QA row: its "
                        "answers, e.g. 125 for a 32k case file with 16 questions): the chunked loss builds logits "
                        "only for them")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="layer checkpoints in host memory, fetched one layer ahead (parallelism.offload_checkpoints; "
                        "default: consider both on GPUs, recommended only when needed to fit)")
    p.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="the MLP over token tiles with recompute (parallelism.tiled_mlp; default: consider both, "
                        "recommended only when needed to fit)")
    p.add_argument("--mlp-tile", default=None, metavar="TOKENS",
                   help="tokens per tile of the tiled MLP (parallelism.mlp_tile_tokens, e.g. 512 or 2k; default: the "
                        "hidden size, as training does)")
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="shard weights, gradients and AdamW moments over dp x cp (parallelism.fsdp; default: FSDP2 "
                        "for full fine-tuning on GPUs; on CPU both are considered)")
    p.add_argument("--layers", type=int, default=None,
                   help="plan the model at this depth (reduced-depth benchmark runs; default: the model's own)")
    p.add_argument("--longest", action="store_true",
                   help="also search the longest sequence (a multiple of 1,024) that fits as the options allow")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward pass per replica")
    p.add_argument("--all", action="store_true", help="list every candidate configuration")
    p.add_argument("--json", action="store_true", help="print the full plan as JSON")
    p.set_defaults(func=_main)


def _tokens(flag: str, text: str | None) -> int | None:
    """A token count given as text (4096, 4k), or None; a bad one is a ValueError naming the flag (one line)."""
    if text is None:
        return None
    try:
        return cliargs.length(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{flag}: {e}") from None


def _main(args: argparse.Namespace) -> int:
    from longdoc.plan.planner import PlanRequest, longest_fitting, plan

    try:
        req = PlanRequest(model=args.model, seq_len=args.seq_len, gpus=args.gpus, gpu=args.gpu,
                          interconnect=args.interconnect, lora=args.lora, checkpointing=args.checkpointing,
                          cp=args.cp, dp=args.dp, strategy=args.strategy, ulysses_size=args.ulysses_size,
                          chunked_loss=not args.no_chunked_loss,
                          loss_chunk=args.loss_chunk, loss_tokens=args.loss_tokens, micro_batch=args.micro_batch,
                          memory_gib=args.memory_gib, offload=args.offload, tiled_mlp=args.tiled_mlp,
                          mlp_tile=_tokens("--mlp-tile", args.mlp_tile), fsdp=args.fsdp, layers=args.layers,
                          precision=args.precision)
        result = plan(req)
        ceiling = max(req.seq_len, 1 << 24)
        longest = longest_fitting(dataclasses.replace(req, seq_len=ceiling)) if args.longest else None
    except ValueError as e:
        print(f"longdoc plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        extra = {"longest_fitting": longest, "longest_searched_up_to": ceiling} if args.longest else {}
        print(json.dumps(result.to_dict() | extra, indent=2))
    else:
        from longdoc.plan.report import render_plan

        print(render_plan(result, show_all=args.all))
        if longest is not None:
            at_least = "at least " if longest == ceiling else ""  # the search's ceiling fits: longer may too
            print(f"longest sequence that fits as the options allow: {at_least}{longest:,} tokens" if longest else
                  "no sequence length fits as the options allow")
    return 0 if result.best is not None else 1
