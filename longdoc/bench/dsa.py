"""Sparse indexed attention (DeepSeek DSA) benchmark: a tiny DeepSeek-V3.2 shape, one process vs CP, and DSA
vs dense causal attention of the same shape (DeepSeek-V3's MLA without the indexer).

    longdoc bench dsa                         # 16k tokens, index_topk 2048, CP=2 (the measured row)
    longdoc bench dsa --quick                 # 2k tokens, index_topk 256 (a smoke run)

Four runs, each in fresh processes so that every peak is its own (peak RSS, VmHWM reset after the warm-up):
  single DSA    transformers' own DeepseekV32ForCausalLM forward+backward, one process x `ranks` threads
                (it scores every query against every key at once: (S x index heads x S) fp32 scores)
  single dense  DeepseekV3ForCausalLM of the same shape (no indexer), one process x `ranks` threads
  CP DSA        the patched model on `ranks` ranks x 1 thread (longdoc.hf.kinds.dsa + selected-key attention)
  CP dense      the patched dense model on `ranks` ranks x 1 thread
Ratios: speedup = single / CP time; memory = CP peak (largest rank) / single peak; DSA / dense at equal
parallelism. Times are medians of `repeats` steps after a warm-up step.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from longdoc.bench.attention import timed
from longdoc.runtime.spawn import run_local


@dataclass(kw_only=True)
class DsaBenchConfig:
    seq_len: int = 16384
    index_topk: int = 2048
    layers: int = 2
    hidden_size: int = 256
    heads: int = 4
    index_heads: int = 4
    index_head_dim: int = 64
    ranks: int = 2
    repeats: int = 2
    dtype: str = "float32"
    seed: int = 0


QUICK = DsaBenchConfig(seq_len=2048, index_topk=256, repeats=1)


def _config(cfg: DsaBenchConfig, dense: bool):
    from transformers import AutoConfig

    shape = dict(hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size, num_hidden_layers=cfg.layers,
                 num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, vocab_size=256, q_lora_rank=64,
                 kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
                 max_position_embeddings=max(4096, cfg.seq_len), n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=cfg.hidden_size, n_group=1, topk_group=1, first_k_dense_replace=cfg.layers,
                 mlp_layer_types=["dense"] * cfg.layers, tie_word_embeddings=False)
    if dense:
        return AutoConfig.for_model("deepseek_v3", **shape)
    return AutoConfig.for_model("deepseek_v32", **shape, index_topk=cfg.index_topk, index_n_heads=cfg.index_heads,
                                index_head_dim=cfg.index_head_dim)


def _step_fn(cfg: DsaBenchConfig, dense: bool, cp):
    """A fwd+bwd step of the model on this rank's part of one random sequence (cp None: one process)."""
    from transformers import AutoModelForCausalLM

    import longdoc

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(_config(cfg, dense), attn_implementation="sdpa")
    model = model.to(getattr(torch, cfg.dtype)).train()
    ids = torch.randint(0, 256, (1, cfg.seq_len), generator=torch.Generator().manual_seed(cfg.seed))
    if cp is None:
        batch = {"input_ids": ids, "labels": ids}
    else:
        longdoc.patch(model, cp)
        batch = cp.shard_batch({"input_ids": ids, "labels": ids})

    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    return step


def _run(rank: int, world_size: int, cfg: DsaBenchConfig, dense: bool, parallel: bool) -> tuple[list[float], float]:
    import longdoc
    from longdoc.train.metrics import PeakMemory

    cp = longdoc.ContextParallel(timeout=3600) if parallel else None
    step = _step_fn(cfg, dense, cp)
    sync = dist.barrier if parallel else (lambda: None)
    step()  # warm-up: allocators, thread pools
    peak = PeakMemory(torch.device("cpu"))
    peak.reset()
    times = timed(step, cfg.repeats, sync=sync)
    return times, peak.peak_gb()


def run(cfg: DsaBenchConfig) -> dict:
    """Time and peak memory of the four runs (module docstring); return medians, peaks and ratios."""
    med, peaks = {}, {}
    for name, dense, parallel in (("single/dsa", False, False), ("single/dense", True, False),
                                  ("cp/dsa", False, True), ("cp/dense", True, True)):
        n, threads = (cfg.ranks, 1) if parallel else (1, cfg.ranks)
        per_rank = run_local(n, _run, cfg, dense, parallel, threads=threads, deadline=7200, pg_timeout=3600)
        med[name] = statistics.median(per_rank[0][0])
        peaks[name] = max(p for _, p in per_rank)
    ratios = {"speedup_dsa": med["single/dsa"] / med["cp/dsa"], "memory_dsa": peaks["cp/dsa"] / peaks["single/dsa"],
              "dsa_vs_dense_cp": med["cp/dsa"] / med["cp/dense"],
              "dsa_vs_dense_single": med["single/dsa"] / med["single/dense"],
              "speedup_dense": med["single/dense"] / med["cp/dense"]}
    return {"config": asdict(cfg), "median_s": med, "peak_gib": peaks, "ratios": ratios}


_LABELS = {
    "speedup_dsa": "DSA speedup (one process / CP)",
    "memory_dsa": "DSA peak memory (CP, largest rank / one process)",
    "dsa_vs_dense_cp": "DSA / dense causal time (CP)",
    "dsa_vs_dense_single": "DSA / dense causal time (one process)",
    "speedup_dense": "dense speedup (one process / CP)",
}


def to_markdown(result: dict) -> str:
    cfg, t, p, r = result["config"], result["median_s"], result["peak_gib"], result["ratios"]
    lines = [
        f"Tiny DeepSeek-V3.2 shape ({cfg['layers']} layers, hidden {cfg['hidden_size']}, {cfg['heads']} MLA heads, "
        f"indexer {cfg['index_heads']} x {cfg['index_head_dim']}), {cfg['seq_len']} tokens, index_topk "
        f"{cfg['index_topk']}, {cfg['dtype']}, fwd+bwd; 1 process x {cfg['ranks']} threads vs {cfg['ranks']} ranks x "
        f"1 thread (median of {cfg['repeats']})",
        "",
        "| run | time (s) | peak RSS (GiB, largest rank) |",
        "|---|---:|---:|",
        *(f"| {k} | {t[k]:.2f} | {p[k]:.2f} |" for k in t),
        "",
        *(f"{_LABELS[k]} = {v:.3f}" for k, v in r.items()),
    ]
    return "\n".join(lines)
