"""Step-time cost of DPO with a shared prompt against TRL's two-sequence form (issue 39), side by side in one
process: the same model, prompt and answers, the variants' steps interleaved (A B C A B C ...) so that drifting
machine load hits all alike.

    python -m longdoc.bench.dpo_step                  # SmolLM2-135M-Instruct + the demo's LoRA, a 4k-token prompt
    python -m longdoc.bench.dpo_step --quick          # 2 layers, a 1k-token prompt (a smoke run)

Variants, each one sigmoid-DPO step (forward and backward of longdoc.train.loss.LossModel: the chunked head,
activation checkpointing, bf16 autocast where `train.mixed_precision: auto` picks it, the reference as the model
with its LoRA adapters disabled):
  - two-sequence: TRL's layout, prompt+chosen and prompt+rejected as two rows of one batch: the prompt is computed
    twice, by the policy (forward and backward) and by the reference;
  - shared: longdoc's layout, one row [prompt | chosen | rejected] with sibling branches (chosen and rejected see
    the prompt, never each other): the prompt is computed once by each;
  - shared-cached: the same with the reference's sums cached (what training does from a row's second visit on,
    longdoc.train.dpo_step.ReferenceCache): no reference forward at all.
Random token ids (the cost does not depend on them); chosen and rejected of equal length, so the two-sequence rows
need no padding.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from longdoc.bench.mix_step import _native_bf16, step_bench_main


@dataclass(kw_only=True)
class DpoStepBenchConfig:
    prompt: int = 4096
    answer: int = 48  # tokens of chosen and of rejected (the "answers under 64 tokens")
    layers: int | None = None  # None: the model's 30
    repeats: int = 2  # timed steps of each variant, after one warm-up step each
    threads: int = 2
    autocast: bool = field(default_factory=_native_bf16)
    beta: float = 0.1
    seed: int = 0


QUICK = DpoStepBenchConfig(prompt=1024, answer=32, layers=2, repeats=1)
VARIANTS = ("two-sequence", "shared", "shared-cached")


def _model(cfg: DpoStepBenchConfig):
    """The demo's model as `longdoc train` builds it (longdoc.train.modeling.build's steps), cut to cfg.layers
    before it is patched."""
    import longdoc
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
                                        target_modules=["gate_proj", "up_proj", "down_proj"]))
    cp = longdoc.ContextParallel()
    longdoc.patch(model, cp)
    model.train()
    return LossModel(model), cp


def _two_sequence(cfg: DpoStepBenchConfig, ids: torch.Tensor):
    """(batch, targets): prompt+chosen and prompt+rejected as two rows; each answer token predicted by the
    position before it, in its own row."""
    from longdoc.train.dpo import PairTargets

    p, a = cfg.prompt, cfg.answer
    rows = torch.stack([ids[:p + a], torch.cat([ids[:p], ids[p + a:]])])
    n = p + a
    logit = torch.cat([torch.arange(p - 1, n - 1), n + torch.arange(p - 1, n - 1)])
    targets = PairTargets(logit=logit, token=torch.cat([rows[0, p:], rows[1, p:]]),
                          slot=torch.cat([torch.zeros(a, dtype=torch.long), torch.ones(a, dtype=torch.long)]),
                          lengths=torch.full((2, 1), float(a), dtype=torch.float64))
    return {"input_ids": rows}, targets


def _shared(cfg: DpoStepBenchConfig, ids: torch.Tensor, cp):
    from longdoc.parallel.layout import Branches
    from longdoc.train.dpo import pair_targets

    p, a = cfg.prompt, cfg.answer
    batch = {"input_ids": ids[None], "branches": [Branches(((0, p, p + a, p + 2 * a),))]}
    return batch, pair_targets(batch, cp)


def _step(loss_model, cp, cfg: DpoStepBenchConfig, batch: dict, targets, reference) -> tuple[float, torch.Tensor]:
    from longdoc.parallel.batch import ROW_LENGTHS
    from longdoc.parallel.batch_branches import BRANCHES
    from longdoc.train.dpo import DpoBatch

    local = cp.shard_batch(batch)
    loss_model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
        share, stats = loss_model(local["input_ids"], local["position_ids"], cu_seq_lens=local.get("cu_seq_lens_q"),
                                  row_lengths=local.get(ROW_LENGTHS), branches=local.get(BRANCHES),
                                  dpo=DpoBatch(targets, "sigmoid", cfg.beta, 0.0, 1, cp, reference=reference))
    share.backward()
    return time.perf_counter() - start, stats


def run(cfg: DpoStepBenchConfig, log=print) -> dict:
    """Median step times of the variants, their ratios to two-sequence, the per-pair log-probabilities of both
    layouts (they must agree: the same computation), and the load average around the run."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    loss_model, cp = _model(cfg)
    vocab = loss_model.lm.config.vocab_size
    ids = torch.randint(0, vocab, (cfg.prompt + 2 * cfg.answer,), generator=torch.Generator().manual_seed(cfg.seed))
    two, shared = _two_sequence(cfg, ids), _shared(cfg, ids, cp)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    logps: dict[str, list[float]] = {}
    cached = None
    load_start = os.getloadavg()[0]
    for i in range(cfg.repeats + 1):
        for v in VARIANTS:
            batch, targets = two if v == "two-sequence" else shared
            elapsed, stats = _step(loss_model, cp, cfg, batch, targets, cached if v == "shared-cached" else None)
            if v == "shared":
                cached = stats[2:].double()
            logps[v] = stats.double().flatten().tolist()
            if i:  # the first step of each warms allocators and thread pools
                times[v].append(elapsed)
            log(f"dpo-step bench: {v} step {i}: {elapsed:.2f} s (policy logps {stats[0, 0]:.3f} {stats[1, 0]:.3f})")
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"config": asdict(cfg), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "seconds": times, "median_s": med, "ratio": {v: med[v] / med["two-sequence"] for v in VARIANTS},
            "logps": logps, "load_start": load_start, "load_end": os.getloadavg()[0]}


def to_markdown(res: dict) -> str:
    c = res["config"]
    rows = [f"| {v} | {res['median_s'][v]:.2f} | {res['ratio'][v]:.2f}x |" for v in VARIANTS]
    return "\n".join([
        f"{res.get('date', 'undated')}: SmolLM2-135M-Instruct + LoRA r=16 (MLP), {c['layers'] or 30} layers, a "
        f"{c['prompt']}-token prompt, chosen and rejected {c['answer']} tokens each, sigmoid DPO, {c['threads']} "
        f"threads, {'bf16 autocast' if c['autocast'] else 'fp32'}; load average {res['load_start']:.2f} -> "
        f"{res['load_end']:.2f}", "",
        "| step | seconds (median) | / two-sequence |", "|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> None:
    import sys

    step_bench_main(argv, sys.modules[__name__], DpoStepBenchConfig(), QUICK,
                    "2 layers, a 1k-token prompt, one timed step")


if __name__ == "__main__":
    main()
