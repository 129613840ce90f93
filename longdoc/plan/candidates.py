"""The planner's candidates: one configuration with its memory and step time, which one is recommended, and why
(every strategy at the chosen cp with its step time and what costs it time, or its memory where it does not fit)."""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.parallel import strategy as registry
from longdoc.parallel.ulysses import split_heads
from longdoc.plan import strategies
from longdoc.plan.hardware import GIB
from longdoc.plan.memory import MemoryEstimate, Setup
from longdoc.plan.timing import StepTime

TIE = 0.03  # near ties in throughput: within this fraction of the fastest fitting configuration
# GPU figures are formulas until a device measures them: where some configurations fit with this fraction of the
# device to spare, the recommendation is made among those (a 92%-full plan is one fragmentation away from OOM)
GPU_HEADROOM = 0.15


@dataclass
class Candidate:
    setup: Setup
    memory: MemoryEstimate
    time: StepTime
    capacity_gib: float

    @property
    def fits(self) -> bool:
        return self.memory.total_gib <= self.capacity_gib

    def describe(self) -> str:
        s = self.setup
        kind = registry.get(s.strategy).describe(s.cp, s.ulysses_size)
        return (f"cp={s.cp} dp={s.dp} {kind} {s.layout}, activation checkpointing "
                f"{'on' if s.checkpointing else 'off'}, "
                + (f"chunked loss ({s.loss_chunk} tokens)" if s.loss_chunk else "full logits (no chunked loss)")
                + (", LoRA" if s.lora else "") + (", FSDP2" if s.uses_fsdp else "")
                + (", checkpoints offloaded to host" if s.offload else "")
                + ((f", tiled MLP ({s.mlp_tile:,}-token tiles)" if s.mlp_tile else ", tiled MLP") if s.tiled_mlp
                   else ""))

    def recipe_keys(self) -> str:
        """The recipe overrides that train this configuration (`longdoc train RECIPE key=value ...`)."""
        s = self.setup
        keys = [f"parallelism.cp_size={s.cp}", f"parallelism.strategy={s.strategy}"]
        if s.ulysses_size is not None:  # a factored strategy (usp)
            keys.append(f"parallelism.ulysses_size={s.ulysses_size}")
        keys += [f"parallelism.fsdp={str(s.uses_fsdp).lower()}",
                 f"parallelism.offload_checkpoints={str(s.offload).lower()}",
                 f"parallelism.tiled_mlp={str(s.tiled_mlp).lower()}"]
        if s.tiled_mlp and s.mlp_tile:
            keys.append(f"parallelism.mlp_tile_tokens={s.mlp_tile}")
        keys.append(f"train.activation_checkpointing={str(s.checkpointing).lower()}")
        if s.loss_chunk:
            keys.append(f"train.loss_chunk_tokens={s.loss_chunk}")
        if s.micro_batch > 1:  # the step's batch: one micro-batch per replica (more accumulates, same memory)
            keys += [f"train.micro_batch_size={s.micro_batch}", f"train.batch_size={s.micro_batch * s.dp}"]
        keys.append(f"lora.enabled={str(s.lora).lower()}")
        if s.lora and s.dev.is_gpu:  # the plan prices a frozen bf16 base
            keys.append("model.dtype=bfloat16")
        if not s.dev.is_gpu:  # the precision the plan assumed, pinned (auto picks by the CPU's bf16 support)
            keys.append(f"train.mixed_precision={'bf16' if s.dev.autocast else 'no'}")
        return " ".join(keys)

    def to_dict(self) -> dict:
        s = self.setup
        return {
            "cp": s.cp, "dp": s.dp, "strategy": s.strategy, "ulysses_size": s.ulysses_size,
            "layout": s.layout, "checkpointing": s.checkpointing,
            "loss_chunk": s.loss_chunk, "lora": s.lora, "fsdp": s.uses_fsdp, "tokens_per_rank": s.tokens,
            "offload": s.offload, "tiled_mlp": s.tiled_mlp, "mlp_tile": s.mlp_tokens if s.tiled_mlp else None,
            "recipe_keys": self.recipe_keys(),
            "fits": self.fits, "peak_gib": self.memory.total_gib, "peak_phase": self.memory.peak_phase,
            "allocator_gib": self.memory.allocator_gib,
            "breakdown_gib": {k: v / GIB for k, v in self.memory.breakdown.items()},
            "terms": [{"label": t.label, "category": t.category, "formula": t.formula, "gib": t.bytes / GIB}
                      for t in self.memory.terms],
            "phases_gib": {k: self.memory.phase_total(k) / GIB for k in self.memory.phases},
            "step_s": self.time.total, "step_parts_s": self.time.seconds, "passes_s": self.time.passes,
            "tokens_per_s": self.time.tokens_per_s, "tokens_per_s_per_gpu": self.time.tokens_per_s_per_device,
            "flops_per_rank": self.time.flops, "comm_bytes_per_rank": self.time.comm_bytes,
        }


def _rank_key(c: Candidate) -> tuple:
    # near ties: the smaller cp (more replicas), no checkpointing, no offload, no tiled MLP, no CPU FSDP (each costs
    # copies, recompute or collectives), then simply the faster; the strategy order (ring, allgather, ulysses,
    # usp) only settles exact ties
    s = c.setup
    cpu_fsdp = s.uses_fsdp and not s.dev.is_gpu
    return (s.cp, s.checkpointing, s.offload, s.tiled_mlp, cpu_fsdp, round(c.time.total, 6),
            registry.names().index(s.strategy), -(s.ulysses_size or 0))


def _pool(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates the recommendation is made among: those with the GPU headroom, if any has it."""
    fitting = [c for c in candidates if c.fits]
    roomy = [c for c in fitting if not c.setup.dev.is_gpu
             or c.memory.total_gib <= (1 - GPU_HEADROOM) * c.capacity_gib]
    return roomy or fitting


def choose(candidates: list[Candidate]) -> Candidate | None:
    fitting = _pool(candidates)
    if not fitting:
        return None
    top = max(c.time.tokens_per_s for c in fitting)
    near = [c for c in fitting if c.time.tokens_per_s >= (1 - TIE) * top]
    return min(near, key=_rank_key)




def strategy_label(s: Setup) -> str:
    return registry.get(s.strategy).label(s.cp, s.ulysses_size)


def _why_slower(c: Candidate) -> str:
    s, t = c.setup, c.time
    sh = s.shape
    parts = [f"{t.seconds['exposed_comm']:.3g} s of communication exposed"]
    u = strategies.ulysses_size(s.strategy, s.cp, s.ulysses_size)
    bal = strategies.head_balance(sh.heads, sh.kv_heads, u)
    if bal > 1.0001:
        big = max(b - a for a, b in split_heads(sh.heads, sh.kv_heads, u).q)
        parts.append(f"{sh.heads} query heads over {u} Ulysses ranks: the largest share ({big}) sets the kernel "
                     f"time, x{bal:.2f}")
    return "; ".join(parts)


def explain(cands: list[Candidate], best: Candidate | None) -> str:
    """Why `best`'s strategy: every strategy at the same cp, dp and checkpointing, with its step time and what
    costs it time (exposed communication, uneven heads), or its memory if it does not fit."""
    if best is None:
        return ""
    b = best.setup
    def features(s: Setup) -> tuple:
        return s.cp, s.checkpointing, s.offload, s.tiled_mlp, s.uses_fsdp

    peers = [c for c in cands if features(c.setup) == features(b)]
    if b.cp == 1:
        return "cp=1: no context parallelism, every strategy is the same single-device attention"
    rows = []
    for c in sorted(peers, key=lambda c: c.time.total):
        label = strategy_label(c.setup)
        if not c.fits:
            rows.append(f"{label} does not fit ({c.memory.total_gib:.2f} GiB)")
            continue
        delta = c.time.total / best.time.total - 1
        rows.append(f"{label} {c.time.total:.4g} s/step" + ("" if c is best else f" ({delta:+.1%})")
                    + f" [{_why_slower(c)}]")
    pool = _pool(cands)
    fastest = max(pool, key=lambda c: c.time.tokens_per_s)
    roomy = "" if len(pool) == sum(c.fits for c in cands) else \
        (f" (among the configurations that leave {GPU_HEADROOM:.0%} of the GPU free: GPU figures are unmeasured "
         f"formulas; {sum(c.fits for c in cands) - len(pool)} fitting ones do not)")
    if fastest is best:
        head = f"{strategy_label(b)} is the fastest fitting configuration{roomy}"
    else:
        head = (f"{strategy_label(b)} at cp={b.cp} is within {TIE:.0%} of the fastest ({fastest.describe()}, "
                f"{fastest.time.total:.4g} s/step){roomy}, and near ties go to the smaller cp, then no checkpointing, "
                f"no offload, no tiled MLP, no CPU FSDP, then the faster")
    return f"{head}; at cp={b.cp} dp={b.dp}: " + "; ".join(rows)
