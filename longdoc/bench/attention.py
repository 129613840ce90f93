"""Attention benchmark: CP efficiency, zigzag vs contiguous, ring vs all-gather, side by side.

    longdoc bench attention --seq-len 16384                      # one length: prints E and Z
    longdoc bench attention --lengths 4096,8192,16384            # the sweep (part of `longdoc bench`)

All variants run in one invocation on the same machine, so their ratios are comparable:
  E = time(1 process x T threads, full SDPA) / time(longdoc.attention, T ranks x 1 thread, zigzag ring)
  Z = time(contiguous ring) / time(zigzag ring)      (ideal for 2 ranks: 1.5)
Each time is the median of `repeats` causal forward+backward passes after a warm-up pass.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longdoc.spawn import run_local

VARIANTS = (("zigzag", "ring"), ("contiguous", "ring"), ("zigzag", "allgather"), ("contiguous", "allgather"))


@dataclass(kw_only=True)
class AttentionBenchConfig:
    seq_len: int = 16384
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    ranks: int = 2
    repeats: int = 3
    causal: bool = True
    dtype: str = "float32"


def _inputs(cfg: AttentionBenchConfig):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, cfg.dtype)
    q = torch.randn(1, cfg.heads, cfg.seq_len, cfg.head_dim, generator=g).to(dtype)
    k = torch.randn(1, cfg.kv_heads, cfg.seq_len, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(1, cfg.kv_heads, cfg.seq_len, cfg.head_dim, generator=g).to(dtype)
    dout = torch.randn(1, cfg.heads, cfg.seq_len, cfg.head_dim, generator=g).to(dtype)
    return q, k, v, dout


def timed(step, repeats: int, sync=lambda: None) -> list[float]:
    """Wall times of `repeats` calls of `step` after one warm-up call, `sync` before and after each."""
    times = []
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i:  # the first pass warms up allocators and thread pools
            times.append(time.perf_counter() - start)
    return times


def _single(rank: int, world_size: int, cfg: AttentionBenchConfig) -> list[float]:
    q, k, v, dout = (t.requires_grad_() for t in _inputs(cfg))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout)

    return timed(step, cfg.repeats)


def _cp(rank: int, world_size: int, cfg: AttentionBenchConfig) -> dict[str, list[float]]:
    from longdoc.parallel.api import ContextParallel, attention

    full = _inputs(cfg)
    results = {}
    for layout, strategy in VARIANTS:
        cp = ContextParallel(layout=layout, timeout=900)
        q, k, v = (cp.shard(t, dim=2).requires_grad_() for t in full[:3])
        dout = cp.shard(full[3], dim=2)

        def step():
            out = attention(q, k, v, cp, causal=cfg.causal, strategy=strategy)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), dout)  # noqa: B023

        results[f"{layout}/{strategy}"] = timed(step, cfg.repeats, sync=dist.barrier)
    return results


def _flops(cfg: AttentionBenchConfig) -> float:
    # forward: QK^T and PV, 2 flops per multiply-add; causal halves it. backward: 5 matmuls vs 2.
    fwd = 4 * cfg.heads * cfg.seq_len**2 * cfg.head_dim * (0.5 if cfg.causal else 1.0)
    return fwd * 3.5


def run(cfg: AttentionBenchConfig) -> dict:
    """Time single-process SDPA and every CP variant; return times, ratios and GFLOP/s."""
    single = run_local(1, _single, cfg, threads=cfg.ranks, deadline=3600)[0]
    cp = run_local(cfg.ranks, _cp, cfg, threads=1, deadline=3600, pg_timeout=900)[0]
    med = {"single/sdpa": statistics.median(single)} | {k: statistics.median(v) for k, v in cp.items()}
    ratios = {
        "E": med["single/sdpa"] / med["zigzag/ring"],
        "Z": med["contiguous/ring"] / med["zigzag/ring"],
        "ring_vs_allgather": med["zigzag/allgather"] / med["zigzag/ring"],
    }
    gflops = {k: _flops(cfg) / t / 1e9 for k, t in med.items()}
    return {"config": asdict(cfg), "median_s": med, "ratios": ratios, "gflops": gflops}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Causal attention fwd+bwd, {cfg['seq_len']} tokens, {cfg['heads']} heads ({cfg['kv_heads']} kv), "
        f"head_dim {cfg['head_dim']}, {cfg['dtype']}; single process with {cfg['ranks']} threads vs "
        f"{cfg['ranks']} ranks x 1 thread (median of {cfg['repeats']})",
        "",
        "| variant | time (s) | GFLOP/s |",
        "|---|---:|---:|",
    ]
    for k, t in result["median_s"].items():
        lines.append(f"| {k} | {t:.3f} | {result['gflops'][k]:.1f} |")
    r = result["ratios"]
    lines += ["", f"E (CP efficiency, single / zigzag ring) = {r['E']:.3f}",
              f"Z (contiguous / zigzag) = {r['Z']:.3f}",
              f"all-gather / ring (zigzag) = {r['ring_vs_allgather']:.3f}"]
    return "\n".join(lines)


def sweep(lengths: list[int], base: AttentionBenchConfig, log=print) -> dict:
    """`run` at every length (same heads, ranks and repeats)."""
    runs = []
    for n in lengths:
        result = run(dataclasses.replace(base, seq_len=n))
        r = result["ratios"]
        log(f"  attention {n:>7} tokens: E {r['E']:.3f}  Z {r['Z']:.3f}  all-gather/ring {r['ring_vs_allgather']:.3f}")
        runs.append(result)
    return {"config": asdict(base), "lengths": list(lengths), "runs": runs}


def sweep_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"Causal attention fwd+bwd, {cfg['heads']} heads ({cfg['kv_heads']} kv), head_dim {cfg['head_dim']}, "
             f"{cfg['dtype']}: 1 process x {cfg['ranks']} threads (SDPA) vs {cfg['ranks']} ranks x 1 thread "
             f"(longdoc.attention); median of {cfg['repeats']} (seconds)",
             "",
             "| tokens | SDPA | zigzag ring | contiguous ring | zigzag all-gather | contiguous all-gather | E | Z "
             "| all-gather / ring |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in zip(result["lengths"], result["runs"]):
        t, q = r["median_s"], r["ratios"]
        lines.append(f"| {n:,} | {t['single/sdpa']:.3f} | {t['zigzag/ring']:.3f} | {t['contiguous/ring']:.3f} | "
                     f"{t['zigzag/allgather']:.3f} | {t['contiguous/allgather']:.3f} | {q['E']:.3f} | {q['Z']:.3f} | "
                     f"{q['ring_vs_allgather']:.3f} |")
    lines += ["", "E = SDPA time / zigzag ring time (CP efficiency at equal cores; 1.0 = no loss); "
                  "Z = contiguous / zigzag (ideal 1.5 at 2 ranks)."]
    return "\n".join(lines)
