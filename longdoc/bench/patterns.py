"""Attention-pattern benchmark rows: sliding window, packed documents, sinks, soft-capping.

    from longdoc.bench import patterns
    result = patterns.run(patterns.PatternBenchConfig(seq_len=16384, window=1024, ranks=2))
    print(patterns.to_markdown(result))

All variants run in one invocation on the same machine (one single-process run with `ranks`
threads, then one CP run with `ranks` ranks x 1 thread), so their ratios are comparable:
  window/causal   = time(CP window) / time(CP causal)          target <= 0.35 (1k window, 16k tokens)
  E_window        = time(1 process, windowed) / time(CP window)
  E_packed        = time(1 process, each document on its own) / time(CP packed row)
  E_*_1t          = time(1 process x 1 thread) / (ranks x time(CP)): a lower bound on E that does not
                    depend on how well one process scales over threads (on a shared, oversubscribed
                    machine small kernels on 2 threads can be many times slower than on 1)
  sinks, softcap  = time(CP causal with sinks or soft-capping) / time(CP causal)
  imbalance       = max / mean causal attention work over ranks for packed rows (pure arithmetic on
                    the layout: a token at document position p does p + 1 cells of work)
Each time is the median of `repeats` forward+backward passes after a warm-up pass.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longdoc.bench.attention import timed
from longdoc.runtime.spawn import run_local


@dataclass(kw_only=True)
class PatternBenchConfig:
    seq_len: int = 16384
    window: int = 1024
    softcap: float = 50.0  # Gemma 2's attention soft-cap
    packed_len: int = 32768  # row length of the imbalance rows (the E row uses seq_len)
    max_doc: int = 8192
    rows: int = 8  # random packed rows per imbalance figure (the worst is reported)
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    ranks: int = 2
    repeats: int = 2
    dtype: str = "float32"
    seed: int = 0
    single_variants: tuple[str, ...] = ("window", "packed", "causal", "window_1t", "packed_1t")
    cp_variants: tuple[str, ...] = ("causal", "window", "sinks", "softcap", "packed")


def mixed_doc_lens(total: int, max_doc: int, seed: int) -> tuple[int, ...]:
    """Document lengths from 1 to max_doc, log-uniform (many short notes, some long filings), filling
    a row of `total` tokens exactly (the last document takes the rest)."""
    rng = random.Random(seed)
    lens: list[int] = []
    left = total
    while left > 0:
        n = min(left, max(1, round(2 ** rng.uniform(0, max_doc.bit_length() - 1))))
        lens.append(n)
        left -= n
    return tuple(lens)


def imbalance(doc_lens: tuple[int, ...], world_size: int, layout: str = "zigzag") -> float:
    """max / mean causal attention work over ranks for one packed row (1.0 = perfectly balanced)."""
    from longdoc.parallel.layout import Packed

    packed = Packed(doc_lens).pad_to(world_size)
    pos_in_doc = packed.position_ids()
    work = [float((pos_in_doc[packed.positions(r, world_size, layout)] + 1).sum()) for r in range(world_size)]
    return max(work) / (sum(work) / world_size)


def _inputs(cfg: PatternBenchConfig):
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    shape_q = (1, cfg.heads, cfg.seq_len, cfg.head_dim)
    shape_kv = (1, cfg.kv_heads, cfg.seq_len, cfg.head_dim)
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, generator=g).to(dtype)
    sinks = torch.randn(cfg.heads, generator=g).to(dtype)
    return q, k, v, dout, sinks


def _docs(cfg: PatternBenchConfig, world_size: int):
    from longdoc.parallel.layout import Packed

    return Packed(mixed_doc_lens(cfg.seq_len, cfg.max_doc, cfg.seed)).pad_to(2 * world_size)


def _single(rank: int, world_size: int, cfg: PatternBenchConfig) -> dict[str, list[float]]:
    import longdoc

    q, k, v, dout, _ = _inputs(cfg)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cp = longdoc.ContextParallel()
    docs = _docs(cfg, cfg.ranks)
    starts = docs.starts()

    def windowed():  # the same block skipping on one process: the fair single-process window
        out = longdoc.attention(q, k, v, cp, window=cfg.window)
        torch.autograd.grad(out, (q, k, v), dout)

    def per_document():  # each document on its own with SDPA: the reference for packing
        outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                               enable_gqa=True) for a, b in zip(starts[:-1], starts[1:])]
        torch.autograd.grad(torch.cat(outs, dim=2), (q, k, v), dout)

    def causal():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout)

    steps = {"window": windowed, "packed": per_document, "causal": causal}
    results = {}
    threads = torch.get_num_threads()
    for name in cfg.single_variants:
        torch.set_num_threads(1 if name.endswith("_1t") else threads)
        results[name] = timed(steps[name.removesuffix("_1t")], cfg.repeats)
    torch.set_num_threads(threads)
    return results


def _cp(rank: int, world_size: int, cfg: PatternBenchConfig) -> dict[str, list[float]]:
    import longdoc

    q_full, k_full, v_full, dout_full, sinks = _inputs(cfg)
    cp = longdoc.ContextParallel(timeout=1800)
    docs = _docs(cfg, world_size)
    variants = {
        "causal": ({}, None),
        "window": ({"window": cfg.window}, None),
        "sinks": ({"sinks": sinks.clone().requires_grad_()}, None),
        "softcap": ({"softcap": cfg.softcap}, None),
        "packed": ({"documents": docs}, docs),
    }
    results = {}
    for name in cfg.cp_variants:
        kwargs, packed = variants[name]
        q, k, v = (cp.shard(t, dim=2, documents=packed).requires_grad_() for t in (q_full, k_full, v_full))
        dout = cp.shard(dout_full, dim=2, documents=packed)

        def step():
            out = longdoc.attention(q, k, v, cp, **kwargs)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), dout)  # noqa: B023

        results[name] = timed(step, cfg.repeats, sync=dist.barrier)
    return results


def run(cfg: PatternBenchConfig) -> dict:
    """Time every pattern variant side by side; return times, ratios and packed-row imbalance."""
    single = run_local(1, _single, cfg, threads=cfg.ranks, deadline=7200)[0]
    cp = run_local(cfg.ranks, _cp, cfg, threads=1, deadline=7200, pg_timeout=1800)[0]
    med = {f"single/{k}": statistics.median(v) for k, v in single.items()}
    med |= {f"cp/{k}": statistics.median(v) for k, v in cp.items()}
    wanted = {
        "window_vs_causal": ("cp/window", "cp/causal", 1), "E_window": ("single/window", "cp/window", 1),
        "E_window_1t": ("single/window_1t", "cp/window", cfg.ranks),
        "E_packed": ("single/packed", "cp/packed", 1), "E_packed_1t": ("single/packed_1t", "cp/packed", cfg.ranks),
        "E_causal": ("single/causal", "cp/causal", 1), "sinks_overhead": ("cp/sinks", "cp/causal", 1),
        "softcap_overhead": ("cp/softcap", "cp/causal", 1),
    }
    ratios = {k: med[a] / (n * med[b]) for k, (a, b, n) in wanted.items() if a in med and b in med}
    balance = {}
    for length in sorted({cfg.packed_len, cfg.seq_len}):
        for world_size in (2, 4):
            for layout in ("zigzag", "contiguous"):
                worst = max(imbalance(mixed_doc_lens(length, cfg.max_doc, cfg.seed + i), world_size, layout)
                            for i in range(cfg.rows))
                balance[f"{length}/cp{world_size}/{layout}"] = worst
    return {"config": asdict(cfg), "median_s": med, "ratios": ratios, "imbalance": balance}


_LABELS = {
    "window_vs_causal": "window / causal (CP; target <= 0.35)",
    "E_window": "E window (single-process windowed / CP)",
    "E_window_1t": "E window, 1-thread bound (single x 1 thread / (ranks x CP))",
    "E_packed": "E packed (each document on its own / CP packed row; target >= 0.90)",
    "E_packed_1t": "E packed, 1-thread bound",
    "E_causal": "E causal (SDPA / CP)",
    "sinks_overhead": "sinks / causal (CP)",
    "softcap_overhead": "softcap / causal (CP)",
}


def to_markdown(result: dict) -> str:
    cfg, t, r = result["config"], result["median_s"], result["ratios"]
    lines = [
        f"Attention patterns fwd+bwd, {cfg['seq_len']} tokens, {cfg['heads']} heads ({cfg['kv_heads']} kv), "
        f"head_dim {cfg['head_dim']}, {cfg['dtype']}; 1 process x {cfg['ranks']} threads vs {cfg['ranks']} ranks "
        f"x 1 thread (median of {cfg['repeats']}, seconds)",
        "",
        "| variant | time (s) |",
        "|---|---:|",
        *(f"| {k} | {v:.3f} |" for k, v in t.items()),
        "",
        *(f"{_LABELS[k]} = {v:.3f}" for k, v in r.items()),
        "",
        f"Packed rows, documents of 1..{cfg['max_doc']} tokens (log-uniform), worst of {cfg['rows']} rows: "
        "imbalance = max/mean causal work over ranks (target <= 1.05)",
        "",
        "| row | cp | zigzag (per document) | contiguous |",
        "|---:|---:|---:|---:|",
    ]
    lengths = sorted({int(k.split("/")[0]) for k in result["imbalance"]})
    for n in lengths:
        for world_size in (2, 4):
            b = result["imbalance"]
            lines.append(f"| {n:,} | {world_size} | {b[f'{n}/cp{world_size}/zigzag']:.4f} | "
                         f"{b[f'{n}/cp{world_size}/contiguous']:.3f} |")
    return "\n".join(lines)
