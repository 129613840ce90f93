"""`longdoc verify`: one CP forward+backward of YOUR model against a single-process reference.

    longdoc verify --model SmolLM2-135M-Instruct --cp 2 --seq-len 2048
    longdoc verify --model tiny:qwen3 --cp 4 --seq-len 1000 --dtype bfloat16 --strategy allgather
    longdoc verify --model SmolLM2-135M-Instruct --cp 4 --seq-len 2048 --strategy usp --ulysses-size 2
    longdoc verify --model path/to/config.json --cp 2 --seq-len 4096        # random init from a config

It spawns --cp gloo ranks on this machine's CPUs (or, started by `torchrun` / `accelerate launch --multi_gpu
--num_processes N`, joins their group), runs the patched model on a random batch with cp.shard_batch, then (on rank
0 alone, with every core) the unpatched model on the full batch, and prints the largest errors of the logits, the
loss (sum of the rank shares) and the gradients (summed over ranks), and what the run exercised: the attention
patterns (sliding windows, chunks, soft-capping, sinks, padding) and every other layer kind (state passing, conv
halos, DSA's selected keys, the router loss), with a PASS/FAIL verdict against dtype-based tolerances: exit status
0 on PASS, 1 on FAIL, 2 on bad input (one line on stderr, the same with any --cp), 3 on an internal error (a bug).
Models run in eval mode (no dropout), gradients still flow. For bfloat16/float16, both the CP run and the
single-process run in that dtype are compared with a float64 reference: CP passes when it is no worse than 2x the
single-process rounding error (plus a small floor).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

from longdoc import cliargs
from longdoc.errors import EXIT_CODES
from longdoc.models import zoo
from longdoc.parallel import strategy as registry
from longdoc.parallel.layout import LAYOUTS


class Errors(NamedTuple):
    """One comparison's errors (a plain list of the four numbers reads the same)."""

    logits_abs: float  # logits max abs err
    logits_rel: float  # logits max abs err / max |reference logit|
    loss_abs: float  # loss abs err
    grads_rel: float  # max over tensors of max abs err / max |reference grad|


class Tolerance(NamedTuple):
    """Bounds on the judged errors."""

    logits_rel: float
    loss_abs: float
    grads_rel: float


_JUDGED = Tolerance._fields  # the Errors fields the verdict bounds
_ROW_NAMES = {"logits_abs": "logits max abs err", "logits_rel": "logits err / max |logit|",
              "loss_abs": "loss abs err", "grads_rel": "grads max rel err"}

_TOLERANCES = {
    # the loss: transformers computes its cross-entropy in float32 whatever the logits' dtype (so does the CP
    # loss, to match it), so a float64 run's two losses differ by float32 rounding of their sums
    "float64": Tolerance(1e-9, 1e-5, 1e-8),
    "float32": Tolerance(1e-4, 1e-4, 1e-3),
}
_LOW_PRECISION_FLOOR = {"bfloat16": Tolerance(5e-3, 5e-3, 1e-2), "float16": Tolerance(1e-3, 1e-3, 2e-3)}


@dataclass(frozen=True)
class Spec:
    model: str
    cp: int
    seq_len: int
    batch_size: int = 1
    dtype: str = "float32"
    layout: str = "zigzag"
    strategy: str = "ring"
    seed: int = 0
    timeout: float = 600.0
    text: str | None = None
    ulysses_size: int | None = None  # strategy "usp": ranks per Ulysses group


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check CP against a single-process run on your model (PASS/FAIL)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"tiny:<arch> models: {zoo.describe()}.\n\n{EXIT_CODES}.")
    p.add_argument("--model", required=True,
                   help="model name/folder/hub id, 'tiny:<arch>' (listed below) or a config.json (random init)")
    p.add_argument("--cp", type=int, required=True, help="context-parallel ranks")
    p.add_argument("--seq-len", type=cliargs.length, required=True,
                   help="tokens per sequence (any length; e.g. 4096, 4k)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--layout", default="zigzag", choices=LAYOUTS)
    p.add_argument("--strategy", default="ring", choices=registry.names())
    p.add_argument("--ulysses-size", type=int, default=None,
                   help="with --strategy usp: ranks per Ulysses group (a divisor of --cp; ring across the groups)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (and of random init)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="tokenize this text file (repeated to --seq-len) instead of using random tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / cp)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any collective may wait")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.cp < 1 or args.seq_len < 2 or args.batch_size < 1:
        raise ValueError(f"need --cp >= 1, --seq-len >= 2 and --batch-size >= 1, got --cp {args.cp} --seq-len "
                         f"{args.seq_len} --batch-size {args.batch_size}")
    if args.text is not None and not os.path.isfile(args.text):
        raise FileNotFoundError(f"--text {args.text!r} is not a file")
    if registry.get(args.strategy).factored != (args.ulysses_size is not None) or \
            (args.ulysses_size is not None and (args.ulysses_size < 1 or args.cp % args.ulysses_size)):
        raise ValueError(f"--strategy usp goes with --ulysses-size U, a divisor of --cp (and --ulysses-size with "
                         f"--strategy usp only), got --strategy {args.strategy} --ulysses-size {args.ulysses_size} "
                         f"--cp {args.cp}")
    spec = Spec(args.model, args.cp, args.seq_len, args.batch_size, args.dtype, args.layout, args.strategy,
                args.seed, args.timeout, args.text, args.ulysses_size)
    from longdoc.runtime.launch import launched_world

    if (launch := launched_world()).launched:  # started by torchrun / accelerate launch
        return _main_launched(spec, launch.world_size)
    from longdoc.errors import USER_ERRORS
    from longdoc.runtime.spawn import run_local

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.cp)
    print(f"longdoc verify: {args.model}, cp={args.cp} ({args.layout}, {args.strategy}), "
          f"{args.batch_size}x{args.seq_len} tokens, {args.dtype}, {threads} thread(s) per rank", flush=True)
    results = run_local(args.cp, _rank, spec, deadline=4 * args.timeout + 600, pg_timeout=args.timeout,
                        threads=threads, input_errors=USER_ERRORS)
    return _report(spec, results[0])


def _main_launched(spec: Spec, world_size: int) -> int:
    from longdoc.runtime.launch import process_group

    if world_size != spec.cp:  # before joining: every rank stops with the same message, none waits
        raise ValueError(f"--cp {spec.cp} but the launcher started {world_size} processes; pass --cp {world_size}")
    with process_group("gloo", timeout=spec.timeout) as world:
        result = _rank(world.rank, world.world_size, spec)
        return _report(spec, result) if world.is_main else 0


# ---- one rank ----

def _load(spec: Spec, dtype):
    from longdoc import models

    if spec.model.startswith(models.TINY_PREFIX):
        return models.tiny_model(models.arch_of(spec.model), seed=spec.seed, dtype=dtype)
    if spec.model.endswith(".json") and os.path.isfile(spec.model):
        # every rank builds the same random weights from the seed
        return models.from_config(models.load_config(spec.model), seed=spec.seed, dtype=dtype)
    return models.load(spec.model, dtype=dtype)[0]


def _tokens(spec: Spec, vocab: int):
    """(batch, seq_len) token ids: random, or the --text file tokenized and repeated to length."""
    import torch

    from longdoc import models

    if spec.text is None:
        g = torch.Generator().manual_seed(spec.seed)
        return torch.randint(0, vocab, (spec.batch_size, spec.seq_len), generator=g)
    own = not spec.model.startswith(models.TINY_PREFIX) and not spec.model.endswith(".json")
    tokenizer = models.load_tokenizer(spec.model if own else models.DEFAULT_MODEL)
    with open(spec.text, encoding="utf-8") as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"], dtype=torch.long) % vocab
    if ids.numel() == 0:
        raise ValueError(f"{spec.text} has no tokens")
    ids = ids.repeat(-(-spec.batch_size * spec.seq_len // ids.numel()))
    return ids[: spec.batch_size * spec.seq_len].reshape(spec.batch_size, spec.seq_len)


def _step(model, batch: dict, outputs: dict | None = None):
    """Forward + backward; returns (logits, loss, {name: grad}) detached. `outputs`: gets "router_loss", whether
    the loss held a router (load-balancing) term."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    if outputs is not None:
        outputs["router_loss"] = getattr(out, "aux_loss", None) is not None
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _errors(logits, loss, grads, ref_logits, ref_loss, ref_grads) -> Errors:
    """The errors of (logits, loss, grads) against the reference ones."""
    d = (logits.double() - ref_logits.double()).abs()
    scale = ref_logits.double().abs().max().clamp_min(1e-30)
    logit_abs = d.max().item() if d.numel() else 0.0
    grad_rel = 0.0
    for name, g in ref_grads.items():
        mine = grads.get(name)
        diff = (g.double() if mine is None else mine.double() - g.double()).abs().max()
        grad_rel = max(grad_rel, (diff / g.double().abs().max().clamp_min(1e-30)).item())
    return Errors(logit_abs, logit_abs / scale.item(), abs(loss.item() - ref_loss.item()), grad_rel)


def _rank(rank: int, world_size: int, spec: Spec) -> dict | None:
    """CP step on every rank; then rank 0 alone (with every core) runs the references and compares.
    Returns the result dict on CP rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from longdoc.hf import patch, unpatch
    from longdoc.parallel import layout as layouts
    from longdoc.parallel.api import ContextParallel

    dtype = getattr(torch, spec.dtype)
    model = _load(spec, dtype).eval()  # eval: no dropout anywhere; gradients still flow
    if dtype == torch.float64:
        _float64_experts(model)
    ids = _tokens(spec, model.get_input_embeddings().weight.shape[0])
    full = {"input_ids": ids, "labels": ids}
    cp = ContextParallel(layout=spec.layout, timeout=spec.timeout, ulysses_size=spec.ulysses_size)

    patch(model, cp, strategy=spec.strategy)
    outputs: dict = {}
    logits, loss, grads = _step(model, cp.shard_batch(full), outputs)
    seen = dict(model._longdoc_cp.patterns_seen)
    calls = dict(model._longdoc_cp.kind_calls)
    unpatch(model)
    loss = loss.double()
    if cp.size > 1:
        # Only rank 0 compares, so only it needs the summed loss/grads and everyone's logits: the
        # other ranks never hold a full-length tensor.
        root = dist.get_global_rank(cp.group, 0)
        dist.reduce(loss, root, group=cp.group)
        for t in grads.values():
            dist.reduce(t, root, group=cp.group)
        parts = [torch.empty_like(logits) for _ in range(cp.size)] if cp.rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=root, group=cp.group)
        if cp.rank != 0:
            return None
        logits = layouts.unshard(parts, 1, cp.layout)
        del parts
    logits = logits[:, : spec.seq_len]
    torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done: the reference gets every core

    ref_logits, ref_loss, ref_grads = _step(model, full)
    result = {"cp_vs_single": _errors(logits, loss, grads, ref_logits, ref_loss, ref_grads)}
    if spec.dtype in _LOW_PRECISION_FLOOR:
        model.to(torch.float64)
        _float64_experts(model)
        hi = _step(model, full)
        result["cp_vs_fp64"] = _errors(logits, loss, grads, *hi)
        result["single_vs_fp64"] = _errors(ref_logits, ref_loss, ref_grads, *hi)
    result["loss"] = (loss.item(), ref_loss.item())
    result["patterns"] = exercised(seen, layouts.round_up(spec.seq_len, cp.multiple) - spec.seq_len)
    result["kinds"] = kinds_exercised(calls, outputs["router_loss"])
    return result


def _float64_experts(model) -> None:
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel


def exercised(seen: dict, padding: int) -> list[str]:
    """The attention patterns a CP forward computed, per kind with its layer count, from the patched model's
    record (longdoc.hf.attention: layer -> LayerPattern.seen) and the internal padding of the row."""
    n = len(seen)
    counts: dict[str, int] = {}
    for window, chunk, softcap, sinks, documents, _ in seen.values():
        mask = f"sliding window {window}" if window else f"chunked attention {chunk}" if chunk else "full causal"
        kinds = [mask, f"logit soft-capping {softcap:g}" if softcap else None, "attention sinks" if sinks else None,
                 f"packed documents ({documents} per row)" if documents > 1 else None]
        kinds = [k for k in kinds if k]
        for k in kinds:
            counts[k] = counts.get(k, 0) + 1
    out = [f"{k} ({c} of {n} layers)" for k, c in counts.items()]
    if padding:
        out.append(f"padding ({padding} tokens, to the layout's multiple; never counted)")
    return out


# What each layer kind (longdoc.hf.kinds, by name) does under CP, in the report's words.
_STATE = "state passing"
_KIND_WORDS = {
    "mamba2": f"{_STATE} (Mamba2 SSD) and conv halos",
    "mamba2_parallel": f"{_STATE} (Mamba2 SSD beside attention) and conv halos",
    "mamba": f"{_STATE} (Mamba selective scan) and conv halos",
    "shortconv": "conv halos (short convolutions)",
    "inkling": "conv halos (short convolutions)",
    "zaya_cca": "conv halos and a one-token shift (ZAYA CCA)",
    "gated_deltanet": f"{_STATE} (gated delta rule) and conv halos",
    "kda": f"{_STATE} (Kimi delta attention) and conv halos",
    "lightning": f"{_STATE} (lightning attention)",
    "rglru": f"{_STATE} (RG-LRU) and conv halos",
    "rwkv": f"{_STATE} (RWKV) and token-shift halos",
    "xlstm": f"{_STATE} (mLSTM)",
    "dsa_indexer": "selected keys (DSA: each query's top-k over every earlier key of the whole sequence)",
    "llama4_temperature": "attention temperature by global position (Llama 4)",
}


def kinds_exercised(calls: dict[str, int], router_loss: bool) -> list[str]:
    """The layer kinds beyond attention a CP forward ran (the patched model's record, longdoc.hf.kinds: kind name ->
    calls, one per layer in a forward without recompute) and whether its loss held a router term."""
    out = [f"{_KIND_WORDS.get(name, name + ' layers')} ({n} layer{'s' if n != 1 else ''})"
           for name, n in calls.items() if n]
    if router_loss:
        out.append("router load-balancing loss (each rank's share of its tokens, summed over the group)")
    return out


# ---- verdict ----

_ROWS = tuple(_ROW_NAMES[f] for f in Errors._fields)


def verdict(spec: Spec, result: dict) -> tuple[bool, list[tuple[str, float, float]]]:
    """(passed, [(check, error, tolerance)]) for the judged quantities (the Tolerance fields)."""
    if spec.dtype in _TOLERANCES:
        tol = _TOLERANCES[spec.dtype]
        errs = Errors(*result["cp_vs_single"])
    else:
        floor = _LOW_PRECISION_FLOOR[spec.dtype]
        errs = Errors(*result["cp_vs_fp64"])
        single = Errors(*result["single_vs_fp64"])
        tol = Tolerance(*(2 * getattr(single, f) + getattr(floor, f) for f in _JUDGED))
    rows = [(_ROW_NAMES[f], getattr(errs, f), getattr(tol, f)) for f in _JUDGED]
    return all(e <= t for _, e, t in rows), rows


def _report(spec: Spec, result: dict) -> int:
    passed, rows = verdict(spec, result)
    cp_loss, ref_loss = result["loss"]
    if result.get("patterns"):
        print(f"attention patterns exercised: {'; '.join(result['patterns'])}")
    if result.get("kinds"):
        print(f"layer kinds exercised: {'; '.join(result['kinds'])}")
    print(f"\nloss: CP (sum of {spec.cp} shares) {cp_loss:.8f}   single process {ref_loss:.8f}")
    print(f"{'':28s}{'CP vs single':>15s}" + (f"{'CP vs fp64':>15s}{'single vs fp64':>16s}"
                                              if "cp_vs_fp64" in result else ""))
    for i, name in enumerate(_ROWS):
        line = f"{name:28s}{result['cp_vs_single'][i]:15.3e}"
        if "cp_vs_fp64" in result:
            line += f"{result['cp_vs_fp64'][i]:15.3e}{result['single_vs_fp64'][i]:16.3e}"
        print(line)
    basis = "CP vs single" if spec.dtype in _TOLERANCES else "CP vs fp64, tolerance 2x single vs fp64 + floor"
    print(f"\nchecks ({spec.dtype}, {basis}):")
    for name, err, tol in rows:
        print(f"  {name:28s}{err:11.3e}  <= {tol:9.3e}  {'ok' if err <= tol else 'FAIL'}")
    print(f"\n{'PASS' if passed else 'FAIL'}: {spec.model} under CP={spec.cp} "
          f"{'matches' if passed else 'does NOT match'} the single-process run")
    sys.stdout.flush()
    return 0 if passed else 1
