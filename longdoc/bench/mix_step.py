"""Step-time cost of a training mix's document loss and KL term (issue 37), side by side in one process: the same
model and row, the variants' steps interleaved (A B C A B C ...) so that drifting machine load hits all alike.

    python -m longdoc.bench.mix_step                  # SmolLM2-135M-Instruct, LoRA as the demo, one 4k-token QA row
    python -m longdoc.bench.mix_step --quick          # 2 layers, 1k tokens (a smoke run)

Variants, each one forward and backward of longdoc.train.loss.LossModel (the chunked head, activation checkpointing,
bf16 autocast where `train.mixed_precision: auto` picks it):
  - answers: the loss on the answer tokens only (today's demo);
  - mix-drawn: + document loss 0.1 and KL(base || tuned) 1.0 at `context_positions` drawn document positions
    (longdoc.train.weights.draw_context, as training draws them): the base's forward, and the head at n positions;
  - mix-all: the same terms at every document token (the mix before `context_positions`).
The row is a document of `seq_len - answers` tokens followed by `answers` answer tokens (a QA row's shape; random
ids: the cost does not depend on them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


def _native_bf16() -> bool:
    from longdoc.plan.hardware import cpu_precision

    return cpu_precision() == "bf16"


@dataclass(kw_only=True)
class MixStepBenchConfig:
    seq_len: int = 4096
    answers: int = 200  # answer tokens at the row's end (the demo's rows hold ~15 short answers)
    context_positions: int = 256
    document_weight: float = 0.1
    kl_weight: float = 1.0
    layers: int | None = None  # None: the model's 30
    repeats: int = 3  # timed steps of each variant, after one warm-up step each
    threads: int = 2
    autocast: bool = field(default_factory=_native_bf16)
    seed: int = 0


QUICK = MixStepBenchConfig(seq_len=1024, answers=64, context_positions=64, layers=2, repeats=1)
VARIANTS = ("answers", "mix-drawn", "mix-all")


def _model(cfg: MixStepBenchConfig):
    from longdoc.models import load
    from longdoc.train.config import LoraConfig
    from longdoc.train.loss import LossModel
    from longdoc.train.modeling import _add_lora

    model, _ = load("SmolLM2-135M-Instruct")
    if cfg.layers is not None:
        model.model.layers = model.model.layers[:cfg.layers]
        model.config.num_hidden_layers = cfg.layers
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _add_lora(model, LoraConfig(enabled=True, r=16, alpha=32,
                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    return LossModel(model)


def _targets(cfg: MixStepBenchConfig, ids: torch.Tensor, variant: str) -> dict[str, torch.Tensor]:
    """The shifted labels and weights of one row for a variant (what the trainer hands LossModel at cp=1)."""
    from longdoc.train.weights import draw_context

    n = ids.shape[1]
    doc = n - cfg.answers
    labels = torch.full_like(ids, -100)
    labels[:, doc - 1:-1] = ids[:, doc:]  # shifted: position t predicts token t + 1
    out: dict[str, torch.Tensor] = {"labels": labels, "num_loss_tokens": torch.tensor(float(cfg.answers))}
    if variant == "answers":
        return out
    context = torch.zeros(n, dtype=torch.bool)
    context[:doc - 1] = True
    factor = draw_context(context, cfg.context_positions, (cfg.seed, 0, 0, 0)) if variant == "mix-drawn" \
        else torch.ones(n, dtype=torch.float64)
    kept = context & (factor > 0)
    labels[0, kept] = torch.roll(ids[0], -1)[kept]  # the drawn document tokens become targets too
    loss_w = torch.where(labels[0] != -100, 1.0, 0.0).double()
    loss_w[kept] = cfg.document_weight * factor[kept]
    kl = torch.zeros(n, dtype=torch.float64)
    kl[kept] = cfg.kl_weight * factor[kept]
    out.update(labels=labels, loss_weights=loss_w[None].float(), kl_weights=kl[None].float(),
               num_kl_tokens=torch.tensor(int(context.sum())),
               num_loss_tokens=torch.tensor(cfg.answers + cfg.document_weight * int(context.sum())))
    return out


def run(cfg: MixStepBenchConfig, log=print) -> dict:
    """Median step times of the variants, their ratios to `answers`, and the load average around the run."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    loss_model = _model(cfg)
    vocab = loss_model.lm.config.vocab_size
    ids = torch.randint(0, vocab, (1, cfg.seq_len), generator=torch.Generator().manual_seed(cfg.seed))
    positions = torch.arange(cfg.seq_len)[None]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    load_start = os.getloadavg()[0]
    for i in range(cfg.repeats + 1):
        for v in VARIANTS:
            t = _targets(cfg, ids, v)
            loss_model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
                share, _ = loss_model(ids, positions, t["labels"], num_loss_tokens=float(t["num_loss_tokens"]),
                                      loss_weights=t.get("loss_weights"), kl_weights=t.get("kl_weights"),
                                      num_kl_tokens=int(t.get("num_kl_tokens", 1)))
            share.backward()
            elapsed = time.perf_counter() - start
            if i:  # the first step of each warms allocators and thread pools
                times[v].append(elapsed)
            log(f"mix-step bench: {v} step {i}: {elapsed:.2f} s (loss {float(share):.4f})")
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"config": asdict(cfg), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "seconds": times, "median_s": med, "ratio": {v: med[v] / med["answers"] for v in VARIANTS},
            "load_start": load_start, "load_end": os.getloadavg()[0]}


def to_markdown(res: dict) -> str:
    c = res["config"]
    rows = [f"| {v} | {res['median_s'][v]:.2f} | {res['ratio'][v]:.2f}x |" for v in VARIANTS]
    return "\n".join([
        f"{res.get('date', 'undated')}: SmolLM2-135M-Instruct + LoRA r=16 (q/k/v/o), {c['layers'] or 30} layers, "
        f"{c['seq_len']} tokens ({c['answers']} answer tokens), context_positions {c['context_positions']}, "
        f"{c['threads']} threads, {'bf16 autocast' if c['autocast'] else 'fp32'}; load average "
        f"{res['load_start']:.2f} -> {res['load_end']:.2f}", "",
        "| step | seconds (median) | / answers |", "|---|---|---|", *rows])


def step_bench_main(argv: list[str] | None, module: Any, default: Any, quick: Any, quick_help: str) -> None:
    """The command line every step-time bench shares (`python -m longdoc.bench.<module>`): --quick, --repeats,
    --out; prints the module's table and writes its result as JSON."""
    name = module.__spec__.name if module.__spec__ is not None else module.__name__  # run as -m: __main__
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=module.__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="also write the result as JSON here")
    args = p.parse_args(argv)
    cfg = quick if args.quick else default
    if args.repeats is not None:
        cfg = type(cfg)(**{**asdict(cfg), "repeats": args.repeats})
    res = module.run(cfg)
    print(module.to_markdown(res))
    if args.out:
        from longdoc.eval import report

        report.write_json(args.out, res)


def main(argv: list[str] | None = None) -> None:
    import sys

    step_bench_main(argv, sys.modules[__name__], MixStepBenchConfig(), QUICK, "2 layers, 1k tokens, one timed step")


if __name__ == "__main__":
    main()
