"""Hybrid-model benchmark: a Granite-4.0-H-shaped model (Mamba2 layers, one attention layer in ten, MoE MLPs)
under CP=2 against one process, and what the state exchange moves per layer against ring attention.

    longdoc bench hybrid                        # 16k tokens (part of `longdoc bench`)
    longdoc bench hybrid --seq-len 4096         # another length

One forward+backward of the whole model on random tokens, side by side in one invocation:
  E = time(1 process x T threads) / time(T ranks x 1 thread, zigzag ring, patched), median of `repeats`
  peak = each process's lifetime peak RSS (largest rank), model load included
  bytes per layer = what one rank receives in one forward+backward, counted at longdoc.parallel.comm (all-gather:
  the other ranks' parts; reduce-scatter (gloo: an all-reduce of the stacked parts): the same; ring: every
  received block): state passing (the SSD summaries), conv halos, and ring attention. The state exchange does
  not grow with the sequence; the ring's bytes grow linearly with it.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from longdoc.bench.attention import timed
from longdoc.runtime.spawn import run_local

_CALLERS = {"longdoc.parallel.recurrent.state": "state", "longdoc.parallel.recurrent.halo": "halo",
            "longdoc.parallel.ring": "ring attention", "longdoc.parallel.allgather": "all-gather attention"}


@dataclass(kw_only=True)
class HybridBenchConfig:
    seq_len: int = 16384
    ranks: int = 2
    repeats: int = 2
    layers: int = 10  # one attention layer in ten, as Granite 4.0-H
    hidden: int = 256
    # transformers' torch SSD path keeps (chunk x chunk x heads x state) intermediates per chunk for backward: at
    # 16 heads, state 64, chunk 128 two CP ranks of 8k tokens each outgrew this machine's 24 GiB (measured); 8 heads
    # of 64, state 32, chunk 64 fit (about 11 GiB one process, 9 GiB a rank, extrapolated from 4k)
    mamba_heads: int = 8  # x mamba_head_dim 64 = 2 x hidden (expand 2), n_groups 1
    state: int = 32
    chunk: int = 64
    vocab: int = 2048
    dtype: str = "float32"


def config(cfg: HybridBenchConfig):
    from transformers import AutoConfig

    types = ["attention" if i % 10 == 5 % cfg.layers else "mamba" for i in range(cfg.layers)]
    return AutoConfig.for_model(
        "granitemoehybrid", hidden_size=cfg.hidden, intermediate_size=cfg.hidden, num_hidden_layers=cfg.layers,
        layer_types=types, num_attention_heads=8, num_key_value_heads=2, vocab_size=cfg.vocab,
        mamba_n_heads=cfg.mamba_heads, mamba_d_head=2 * cfg.hidden // cfg.mamba_heads, mamba_n_groups=1,
        mamba_d_state=cfg.state, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=cfg.chunk, num_local_experts=8,
        num_experts_per_tok=2, shared_intermediate_size=cfg.hidden, max_position_embeddings=1 << 20)


def _model(cfg: HybridBenchConfig):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(cfg), attn_implementation="sdpa")
    return model.to(getattr(torch, cfg.dtype))


def _ids(cfg: HybridBenchConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (1, cfg.seq_len), generator=torch.Generator().manual_seed(1))


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@contextlib.contextmanager
def counting(counts: dict[str, int]):
    """Count the bytes this rank receives through longdoc.parallel.comm, by the longdoc module that asked."""
    from longdoc.parallel import comm

    def caller() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = _CALLERS.get(frame.f_globals.get("__name__", ""))
            if name:
                return name
            frame = frame.f_back
        return "other"

    def add(what: str, n: int) -> None:
        counts[what] = counts.get(what, 0) + n

    saved = comm.all_gather, comm.reduce_scatter, comm.Ring.shift

    def all_gather(x, group, *args, **kwargs):
        add(caller(), (dist.get_world_size(group) - 1) * x.numel() * x.element_size())
        return saved[0](x, group, *args, **kwargs)

    def reduce_scatter(parts, *args, **kwargs):
        add(caller(), sum(p.numel() * p.element_size() for p in parts[1:]))
        return saved[1](parts, *args, **kwargs)

    def shift(self, send, recv, *args, **kwargs):
        add(caller(), recv.numel() * recv.element_size())
        return saved[2](self, send, recv, *args, **kwargs)

    comm.all_gather, comm.reduce_scatter, comm.Ring.shift = all_gather, reduce_scatter, shift
    try:
        yield counts
    finally:
        comm.all_gather, comm.reduce_scatter, comm.Ring.shift = saved


def _single(rank: int, world: int, cfg: HybridBenchConfig) -> dict:
    model, ids = _model(cfg), _ids(cfg)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return {"times": timed(step, cfg.repeats), "peak_gib": _peak_gib()}


def _cp(rank: int, world: int, cfg: HybridBenchConfig) -> dict:
    import longdoc

    cp = longdoc.ContextParallel(timeout=1800)
    model = longdoc.patch(_model(cfg), cp)
    local = cp.shard_batch({"input_ids": _ids(cfg), "labels": _ids(cfg)})

    def step():
        model.zero_grad(set_to_none=True)
        model(**local).loss.backward()

    times = timed(step, cfg.repeats, sync=dist.barrier)
    with counting({}) as counts:
        step()
    return {"times": times, "peak_gib": _peak_gib(), "bytes": counts}


def run(cfg: HybridBenchConfig) -> dict:
    """Time one process and CP, record peak memory and the bytes each exchange moves per layer."""
    single = run_local(1, _single, cfg, threads=cfg.ranks, deadline=7200)[0]
    per_rank = run_local(cfg.ranks, _cp, cfg, threads=1, deadline=7200, pg_timeout=1800)
    types = list(config(cfg).layer_types)  # transformers names them linear_attention / full_attention
    n_attn = sum(t in ("attention", "full_attention") for t in types)
    n_mamba = len(types) - n_attn
    t_single = statistics.median(single["times"])
    t_cp = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank)))
    b = per_rank[0]["bytes"]
    per_layer = {"state": b.get("state", 0) / n_mamba, "halo": b.get("halo", 0) / n_mamba,
                 "ring attention": b.get("ring attention", 0) / max(n_attn, 1)}
    return {"config": asdict(cfg), "layer_types": types, "single_s": t_single, "cp_s": t_cp, "E": t_single / t_cp,
            "single_peak_gib": single["peak_gib"], "cp_peak_gib": max(r["peak_gib"] for r in per_rank),
            "bytes_per_layer": per_layer, "bytes_other": b.get("other", 0)}


def to_markdown(result: dict) -> str:
    c, b = result["config"], result["bytes_per_layer"]
    n_attn = sum(t in ("attention", "full_attention") for t in result["layer_types"])
    lines = [f"Granite-4.0-H-shaped model ({c['layers']} layers: {c['layers'] - n_attn} Mamba2 (SSD, "
             f"{c['mamba_heads']} heads, n_groups 1, state {c['state']}) + {n_attn} attention, MoE MLPs, hidden "
             f"{c['hidden']}), "
             f"{c['seq_len']} tokens, {c['dtype']}, forward+backward; 1 process x {c['ranks']} threads vs "
             f"{c['ranks']} ranks x 1 thread (zigzag ring), median of {c['repeats']}",
             "",
             "| run | time (s) | peak RSS GiB (largest rank) |", "|---|---:|---:|",
             f"| one process | {result['single_s']:.2f} | {result['single_peak_gib']:.2f} |",
             f"| cp={c['ranks']} | {result['cp_s']:.2f} | {result['cp_peak_gib']:.2f} |",
             "", f"E (one process / CP) = {result['E']:.3f}",
             "", "Bytes one rank receives per layer in one forward+backward:", "",
             "| exchange | bytes per layer |", "|---|---:|"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in b.items()]
    if b.get("ring attention") and b.get("state"):
        lines += ["", f"state passing moves {b['state'] / b['ring attention']:.2%} of what ring attention moves "
                      f"per layer at this length (it does not grow with the sequence)"]
    return "\n".join(lines)
