"""Attention benchmark: CP efficiency of every strategy, zigzag vs contiguous, side by side.

    longdoc bench attention --seq-len 16384                      # one length: E per strategy, Z
    longdoc bench attention --seq-len 16384 --ranks 4            # usp gets a real 2 x 2 factoring
    longdoc bench attention --lengths 4096,8192,16384            # the sweep (part of `longdoc bench`)

All variants run in one invocation on the same machine, so their ratios are comparable:
  E = time(1 process x T threads, full SDPA) / time(longdoc.attention, T ranks x 1 thread, zigzag ring)
  E_ulysses, E_usp: the same with strategy "ulysses" / "usp" (usp: ring_size x ulysses_size, see --ulysses-size)
  Z = time(contiguous ring) / time(zigzag ring)      (ideal for 2 ranks: 1.5)
Each time is the median of `repeats` causal forward+backward passes after a warm-up pass. Per variant also:
the bytes a rank sends in one forward+backward (counted, longdoc.bench.traffic; the largest rank), and the peak
memory the timed passes add over what a rank held after the warm-up (peak RSS, the largest rank), with freed
memory returned to the OS at once so RSS follows the live tensors.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longdoc.parallel import strategy as registry
from longdoc.runtime.spawn import run_local

VARIANTS = (("zigzag", "ring"), ("contiguous", "ring"), ("zigzag", "allgather"), ("contiguous", "allgather"),
            ("zigzag", "ulysses"), ("zigzag", "usp"))


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
    ulysses_size: int | None = None  # usp's Ulysses groups; None: ranks // 2 where that factors (4 ranks: 2 x 2)

    def usp_size(self) -> int | None:
        """The usp row's ulysses_size, or None: no row (2 ranks have no factoring that is neither ring nor
        ulysses)."""
        if self.ulysses_size is not None:
            return self.ulysses_size
        return self.ranks // 2 if self.ranks >= 4 and self.ranks % 2 == 0 else None


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


def _measured(step, repeats: int, sync=lambda: None) -> dict:
    """Times of `repeats` calls of `step` after a warm-up call, the bytes this rank sent in the warm-up call, and
    the peak memory the timed calls added over what the process held after the warm-up (so one-time start-up
    allocations of the first variant do not count against it)."""
    from longdoc.bench.traffic import counted
    from longdoc.train.metrics import PeakMemory

    peak = PeakMemory(torch.device("cpu"))
    sync()
    with counted() as sent:
        step()
    sync()
    peak.reset()  # the peak RSS restarts from what the process holds now
    before = peak.peak_gb()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return {"times": times, "bytes": sent.bytes, "peak_mib": (peak.peak_gb() - before) * 1024}


def _single(rank: int, world_size: int, cfg: AttentionBenchConfig) -> dict:
    from longdoc.train.metrics import return_freed_memory

    return_freed_memory()
    q, k, v, dout = (t.requires_grad_() for t in _inputs(cfg))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout)

    return _measured(step, cfg.repeats)


def variants(cfg: AttentionBenchConfig) -> list[tuple[str, str, str, int | None]]:
    """(name, layout, strategy, ulysses_size) of the CP rows."""
    out = []
    for layout, strategy in VARIANTS:
        factored = registry.get(strategy).factored
        u = cfg.usp_size() if factored else None
        if factored and u is None:
            continue
        name = f"{layout}/{strategy}" + (f" {cfg.ranks // u}x{u}" if factored else "")
        out.append((name, layout, strategy, u))
    return out


def _cp(rank: int, world_size: int, cfg: AttentionBenchConfig) -> dict[str, dict]:
    from longdoc.parallel.api import ContextParallel, attention
    from longdoc.train.metrics import return_freed_memory

    return_freed_memory()
    full = _inputs(cfg)
    shards = {}
    results = {}
    for name, layout, strategy, u in variants(cfg):
        cp = ContextParallel(layout=layout, timeout=900, ulysses_size=u)
        if layout not in shards:
            shards[layout] = [cp.shard(t, dim=2) for t in full]
        q, k, v = (t.requires_grad_() for t in shards[layout][:3])
        dout = shards[layout][3]

        def step():
            out = attention(q, k, v, cp, causal=cfg.causal, strategy=strategy)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), dout)  # noqa: B023

        results[name] = _measured(step, cfg.repeats, sync=dist.barrier)
    return results


def _flops(cfg: AttentionBenchConfig) -> float:
    # forward: QK^T and PV, 2 flops per multiply-add; causal halves it. backward: 5 matmuls vs 2.
    fwd = 4 * cfg.heads * cfg.seq_len**2 * cfg.head_dim * (0.5 if cfg.causal else 1.0)
    return fwd * 3.5


def run(cfg: AttentionBenchConfig) -> dict:
    """Time single-process SDPA and every CP variant; return times, ratios, GFLOP/s, bytes sent and peaks."""
    single = run_local(1, _single, cfg, threads=cfg.ranks, deadline=3600)[0]
    per_rank = run_local(cfg.ranks, _cp, cfg, threads=1, deadline=3600, pg_timeout=900)
    cp = per_rank[0]
    med = {"single/sdpa": statistics.median(single["times"])} | {k: statistics.median(v["times"])
                                                                  for k, v in cp.items()}
    ratios = {
        "E": med["single/sdpa"] / med["zigzag/ring"],
        "Z": med["contiguous/ring"] / med["zigzag/ring"],
        "ring_vs_allgather": med["zigzag/allgather"] / med["zigzag/ring"],
        "E_ulysses": med["single/sdpa"] / med["zigzag/ulysses"],
    }
    usp = [k for k in cp if "/usp" in k]
    if usp:
        ratios["E_usp"] = med["single/sdpa"] / med[usp[0]]
    gflops = {k: _flops(cfg) / t / 1e9 for k, t in med.items()}
    sent = {"single/sdpa": 0.0} | {k: max(r[k]["bytes"] for r in per_rank) for k in cp}
    peak = {"single/sdpa": single["peak_mib"]} | {k: max(r[k]["peak_mib"] for r in per_rank) for k in cp}
    return {"config": asdict(cfg), "median_s": med, "ratios": ratios, "gflops": gflops, "bytes_per_rank": sent,
            "peak_mib_per_rank": peak}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Causal attention fwd+bwd, {cfg['seq_len']} tokens, {cfg['heads']} heads ({cfg['kv_heads']} kv), "
        f"head_dim {cfg['head_dim']}, {cfg['dtype']}; single process with {cfg['ranks']} threads vs "
        f"{cfg['ranks']} ranks x 1 thread (median of {cfg['repeats']})",
        "",
        "| variant | time (s) | GFLOP/s | MiB sent per rank | peak MiB per rank |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, t in result["median_s"].items():
        lines.append(f"| {k} | {t:.3f} | {result['gflops'][k]:.1f} | {result['bytes_per_rank'][k] / 2**20:.1f} | "
                     f"{result['peak_mib_per_rank'][k]:.0f} |")
    r = result["ratios"]
    lines += ["", f"E (CP efficiency, single / zigzag ring) = {r['E']:.3f}",
              f"E_ulysses (single / ulysses) = {r['E_ulysses']:.3f}"]
    if "E_usp" in r:
        lines.append(f"E_usp (single / usp) = {r['E_usp']:.3f}")
    lines += [f"Z (contiguous / zigzag) = {r['Z']:.3f}", f"all-gather / ring (zigzag) = {r['ring_vs_allgather']:.3f}",
              "", "MiB sent: counted in one forward+backward, largest rank; peak: memory the timed passes add over "
              "what the rank held after the warm-up (peak RSS), largest rank."]
    return "\n".join(lines)


def sweep(lengths: list[int], base: AttentionBenchConfig, log=print) -> dict:
    """`run` at every length (same heads, ranks and repeats)."""
    runs = []
    for n in lengths:
        result = run(dataclasses.replace(base, seq_len=n))
        r = result["ratios"]
        extra = "".join(f"  {k} {r[k]:.3f}" for k in ("E_ulysses", "E_usp") if k in r)
        log(f"  attention {n:>7} tokens: E {r['E']:.3f}  Z {r['Z']:.3f}  all-gather/ring {r['ring_vs_allgather']:.3f}"
            f"{extra}")
        runs.append(result)
    return {"config": asdict(base), "lengths": list(lengths), "runs": runs}


def sweep_markdown(result: dict) -> str:
    cfg = result["config"]
    first = result["runs"][0]["median_s"]
    uly = "zigzag/ulysses" in first  # results from before the Ulysses rows have none
    usp = next((k for k in first if "/usp" in k), None)
    lines = [f"Causal attention fwd+bwd, {cfg['heads']} heads ({cfg['kv_heads']} kv), head_dim {cfg['head_dim']}, "
             f"{cfg['dtype']}: 1 process x {cfg['ranks']} threads (SDPA) vs {cfg['ranks']} ranks x 1 thread "
             f"(longdoc.attention); median of {cfg['repeats']} (seconds)",
             "",
             "| tokens | SDPA | zigzag ring | contiguous ring | zigzag all-gather | contiguous all-gather | E | Z "
             "| all-gather / ring |" + (" ulysses | E ulysses |" if uly else "") + (" usp | E usp |" if usp else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * (bool(uly) + bool(usp))]
    for n, r in zip(result["lengths"], result["runs"]):
        t, q = r["median_s"], r["ratios"]
        extra = (f" {t['zigzag/ulysses']:.3f} | {q['E_ulysses']:.3f} |" if uly else "") + \
            (f" {t[usp]:.3f} | {q['E_usp']:.3f} |" if usp else "")
        lines.append(f"| {n:,} | {t['single/sdpa']:.3f} | {t['zigzag/ring']:.3f} | {t['contiguous/ring']:.3f} | "
                     f"{t['zigzag/allgather']:.3f} | {t['contiguous/allgather']:.3f} | {q['E']:.3f} | {q['Z']:.3f} | "
                     f"{q['ring_vs_allgather']:.3f} |{extra}")
    lines += ["", "E = SDPA time / zigzag ring time (CP efficiency at equal cores; 1.0 = no loss); "
                  "Z = contiguous / zigzag (ideal 1.5 at 2 ranks)"
                  + ("; E ulysses / E usp: the same for those strategies" if uly else "")
                  + (f" ({usp.split('/')[1]})." if usp else ".")]
    return "\n".join(lines)
