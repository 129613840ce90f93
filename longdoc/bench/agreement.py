"""Cost of the batch content agreement in `cp.shard_batch` (checksums + one all-gather) next to a training step.

The check is what stops CP ranks that were handed different sequences from training on a wrong loss; it must
stay a negligible part of a step. Measured side by side in one run on local gloo ranks: `shard_batch` with and
without `check_agreement`, and one forward+backward of a patched tiny model on the same batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from longdoc.runtime.spawn import run_local


@dataclass(kw_only=True)
class AgreementBenchConfig:
    seq_len: int = 4096
    ranks: int = 2
    arch: str = "llama"
    steps: int = 3
    repeats: int = 20


def _rank(rank: int, world_size: int, cfg: AgreementBenchConfig) -> dict[str, float]:
    import torch

    from longdoc.hf.patch import patch
    from longdoc.models import tiny_model
    from longdoc.parallel.api import ContextParallel

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, cfg.seq_len))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    cp = ContextParallel(timeout=300)
    unchecked = ContextParallel(timeout=300, check_agreement=False)
    model = patch(tiny_model(cfg.arch, seed=0), cp)

    def step() -> None:
        model.zero_grad()
        model(**cp.shard_batch(batch)).loss.backward()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    step()  # warm-up
    steps = [timed(step) for _ in range(cfg.steps)]
    on = [timed(lambda: cp.shard_batch(batch)) for _ in range(cfg.repeats)]
    off = [timed(lambda: unchecked.shard_batch(batch)) for _ in range(cfg.repeats)]
    return {"step_s": statistics.median(steps), "shard_checked_s": statistics.median(on),
            "shard_unchecked_s": statistics.median(off)}


def run(cfg: AgreementBenchConfig) -> dict:
    """Per rank: the check's cost (checked - unchecked shard_batch) as a share of one training step."""
    ranks = run_local(cfg.ranks, _rank, cfg, threads=1, deadline=1800, pg_timeout=600)
    for r in ranks:
        r["check_s"] = max(r["shard_checked_s"] - r["shard_unchecked_s"], 0.0)
        r["share_of_step"] = r["check_s"] / r["step_s"]
    return {"config": asdict(cfg), "ranks": ranks, "worst_share": max(r["share_of_step"] for r in ranks)}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    rows = "\n".join(f"| {i} | {r['check_s'] * 1e3:.2f} | {r['step_s'] * 1e3:.0f} | {r['share_of_step']:.3%} |"
                     for i, r in enumerate(result["ranks"]))
    return (f"Batch content agreement in `cp.shard_batch`, tiny {cfg['arch']} at {cfg['seq_len']} tokens, "
            f"cp={cfg['ranks']} (target < 1% of a step)\n\n| rank | check (ms) | fwd+bwd step (ms) | share |\n"
            f"|---:|---:|---:|---:|\n{rows}")
