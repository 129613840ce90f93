"""Step-time cost of the sequence-tiled MLP (longdoc.hf.tiled_mlp), side by side in one process: the same model
and batch, untiled and tiled steps interleaved (A B A B ...) so that drifting machine load hits both alike.

    python -m longdoc.bench.tiled_mlp                 # SmolLM2-135M shape, 8k tokens, 4 of its 30 layers
    python -m longdoc.bench.tiled_mlp --quick         # 1k tokens, 2 layers (a smoke run)

The model is SmolLM2-135M's shape from config (random weights: the cost does not depend on them), checkpointed,
patched at cp=1, with the chunked loss and bf16 autocast as `longdoc train` runs it on a bf16 CPU. Fewer layers
than 30 keep the run short; the ratio is per layer, the embedding / head / loss only dilute it. The tiled MLP
recomputes each MLP forward once more in the backward (on top of the checkpoint's recompute), so its cost is
about one MLP forward per layer and step; the acceptance bound is 5% at 8k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass, field

import torch

# SmolLM2-135M (Llama): hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocab 49152
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True)


def _native_bf16() -> bool:
    from longdoc.plan.hardware import cpu_precision

    return cpu_precision() == "bf16"


@dataclass(kw_only=True)
class TiledMlpBenchConfig:
    seq_len: int = 8192
    layers: int = 4
    tile_tokens: int | None = None  # None: the model's hidden size (the recipe default)
    repeats: int = 3  # timed steps of each variant, after one warm-up step each
    threads: int = 2
    # bf16 autocast where train.mixed_precision=auto picks it (a CPU with native bf16), else fp32
    autocast: bool = field(default_factory=lambda: _native_bf16())
    vocab_size: int = SMOLLM2_135M["vocab_size"]  # smaller only for smoke tests
    seed: int = 0


QUICK = TiledMlpBenchConfig(seq_len=1024, layers=2, repeats=1)


def _model(cfg: TiledMlpBenchConfig, tiled: bool):
    import transformers

    import longdoc
    from longdoc import models
    from longdoc.hf.tiled_mlp import tile_mlps

    config = transformers.LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": cfg.layers, "vocab_size": cfg.vocab_size,
                                         "max_position_embeddings": max(8192, cfg.seq_len)})
    model = models.from_config(config, seed=cfg.seed)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if tiled:
        tile_mlps(model, cfg.tile_tokens)
    cp = longdoc.ContextParallel()
    longdoc.patch(model, cp)
    return model, cp


def run(cfg: TiledMlpBenchConfig, log=print) -> dict:
    """Median step times untiled vs tiled, the ratio, and the load average around the run."""
    import time

    import longdoc

    torch.set_num_threads(cfg.threads)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len),
                        generator=torch.Generator().manual_seed(cfg.seed))
    variants = {name: _model(cfg, name == "tiled") for name in ("untiled", "tiled")}
    batch = {"input_ids": ids, "labels": ids.clone()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    load_start = os.getloadavg()[0]
    for i in range(cfg.repeats + 1):
        for name, (model, cp) in variants.items():
            model.zero_grad(set_to_none=True)
            local = cp.shard_batch(batch)
            start = time.perf_counter()
            with longdoc.hf.chunked_loss(model), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
                loss = model(**local).loss
            loss.backward()
            elapsed = time.perf_counter() - start
            if i:  # the first step of each warms allocators and thread pools
                times[name].append(elapsed)
            log(f"tiled-mlp bench: {name} step {i}: {elapsed:.2f} s")
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"config": asdict(cfg), "tile_tokens": cfg.tile_tokens or SMOLLM2_135M["hidden_size"],
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "seconds": times, "median_s": med, "ratio": med["tiled"] / med["untiled"],
            "load_start": load_start, "load_end": os.getloadavg()[0]}


def to_markdown(res: dict) -> str:
    c = res["config"]
    return "\n".join([
        f"{res.get('date', 'undated')}: SmolLM2-135M shape, {c['layers']} layers, vocabulary {c['vocab_size']}, "
        f"{c['seq_len']} tokens, "
        f"tile {res['tile_tokens']} tokens, "
        f"{c['threads']} threads, {'bf16 autocast' if c['autocast'] else 'fp32'}; load average "
        f"{res['load_start']:.2f} -> {res['load_end']:.2f}", "",
        "| MLP | step (s, median) |", "|---|---|",
        f"| untiled | {res['median_s']['untiled']:.2f} |",
        f"| tiled | {res['median_s']['tiled']:.2f} |", "",
        f"tiled / untiled: {res['ratio']:.3f}"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m longdoc.bench.tiled_mlp", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1k tokens, 2 layers, one timed step")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab-size", type=int, help="a small vocabulary times the decoder layers alone (an upper "
                   "bound of the cost: the head and loss only dilute it)")
    p.add_argument("--tile-tokens", type=int, help="tokens per MLP tile (default: the hidden size, 576)")
    p.add_argument("--threads", type=int, help="torch threads (default 2)")
    p.add_argument("--repeats", type=int, help="timed steps of each variant (default 3)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="default: what training picks on this CPU (bf16 autocast with native bf16, else fp32)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else TiledMlpBenchConfig()
    given = {"seq_len": args.seq_len, "layers": args.layers, "vocab_size": args.vocab_size,
             "tile_tokens": args.tile_tokens, "threads": args.threads, "repeats": args.repeats}
    if args.precision:
        given["autocast"] = args.precision == "bf16"
    cfg = TiledMlpBenchConfig(**{**asdict(cfg), **{k: v for k, v in given.items() if v is not None}})
    res = run(cfg)
    print(to_markdown(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
