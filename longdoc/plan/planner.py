"""`longdoc plan`: will this run fit, with which cp_size, dp and strategy, and how fast will it go?

    longdoc plan --model Llama-3.1-8B --seq-len 131072 --gpus 8 --gpu h100
    longdoc plan --model path/to/config.json --seq-len 65536 --gpus 16 --interconnect ib --lora --json

Every (cp, dp = gpus/cp, strategy, activation checkpointing) the request leaves open is estimated with
the formulas of `memory.py` (per-GPU peak memory, term by term) and `timing.py` (step time with
communication overlap; the four CP strategies: strategies.py). The recommendation is the fitting candidate with
the highest throughput; near ties (within 3%) go to the smaller cp, then no checkpointing, then the faster.
`Plan.reason` says why, with every strategy's step time at the chosen cp. When nothing fits, the plan says by
how much, and what would make it fit: checkpointing, the chunked loss, LoRA, more GPUs, a bigger GPU, or the
longest sequence that fits as asked. Works from a config alone (no weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from longdoc.parallel import strategy as registry
from longdoc.parallel.api import check_strategy
from longdoc.plan.candidates import (  # noqa: F401 - Candidate, choose, TIE and strategy_label re-exported
    TIE,
    Candidate,
    choose,
    explain,
    strategy_label,
)
from longdoc.plan.hardware import (
    GIB,
    INTERCONNECTS,
    PRECISIONS,
    Assumptions,
    Precision,
    cpu_precision,
    device,
    machine_memory_gib,
)
from longdoc.plan.memory import Setup, estimate
from longdoc.plan.shapes import ModelShape, model_shape
from longdoc.plan.timing import estimate_time
from longdoc.runtime.budgets import loss_chunk_tokens


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    seq_len: int
    gpus: int = 8
    gpu: str = "h100"
    interconnect: str = "nvlink"
    lora: bool = False
    checkpointing: bool | None = None  # None: consider both
    cp: int | None = None
    dp: int | None = None
    strategy: str | None = None
    ulysses_size: int | None = None  # pin usp's Ulysses group size (None: every divisor 1 < U < cp)
    chunked_loss: bool = True
    loss_chunk: int | None = None  # None: sized from the vocabulary, as training does (longdoc.runtime.budgets)
    loss_tokens: int | None = None  # labelled tokens per sequence (None: all; QA rows: the answers)
    micro_batch: int = 1
    memory_gib: float | None = None  # override the device's memory
    # None: what training would use: bf16 on GPUs; on "cpu" what `train.mixed_precision: auto` picks on this
    # machine (bf16 autocast on native-bf16 CPUs, else fp32). Resolved at construction, so the plan names it.
    precision: Precision | None = None
    # None: consider both where they can help (offload: on GPUs, with checkpointing), and recommend them only when
    # a run needs them to fit (near ties go to the configuration without: they cost copies and recompute)
    offload: bool | None = None
    tiled_mlp: bool | None = None
    mlp_tile: int | None = None  # tokens per tiled-MLP tile (None: the hidden size, as parallelism.mlp_tile_tokens)
    fsdp: bool | None = None  # parallelism.fsdp; None: FSDP2 for full fine-tuning on GPUs, on CPU both are considered
    layers: int | None = None  # plan the model at this depth (the benchmarks' reduced-depth runs)

    def __post_init__(self):
        device(self.gpu)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision is None:
            object.__setattr__(self, "precision", "bf16" if device(self.gpu).is_gpu else cpu_precision())
        device(self.gpu, self.precision)  # a GPU in fp32: refused with the reason
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(f"--interconnect must be one of {INTERCONNECTS}, got {self.interconnect!r}")
        if self.seq_len < 2 or self.gpus < 1:
            raise ValueError("--seq-len must be at least 2 tokens and --gpus at least 1")
        if self.strategy is not None:
            check_strategy(self.strategy)  # the planner models every strategy
        if self.ulysses_size is not None and (self.strategy is None or not registry.get(self.strategy).factored):
            raise ValueError(f"--ulysses-size goes with --strategy usp (Ulysses inside groups of U ranks, the ring "
                             f"across them); got --strategy {self.strategy}")
        if self.ulysses_size is not None and (self.ulysses_size < 1 or (self.cp and self.cp % self.ulysses_size)):
            raise ValueError(f"--ulysses-size {self.ulysses_size} must divide --cp {self.cp}")
        for name in ("cp", "dp"):
            value = getattr(self, name)
            if value is not None and (value < 1 or self.gpus % value):
                raise ValueError(f"--{name} {value} must divide --gpus {self.gpus}; choose among {divisors(self.gpus)}")
        if self.offload and self.checkpointing is False:
            raise ValueError("--offload moves the layer checkpoints to host memory: it needs --checkpointing")
        if self.fsdp and self.lora:
            raise ValueError("--fsdp shards full fine-tuning's state; with --lora the trainable state is small and "
                             "the frozen base is not sharded by longdoc's trainer")
        if self.mlp_tile is not None and self.mlp_tile < 1:
            raise ValueError(f"--mlp-tile must be a positive number of tokens, got {self.mlp_tile}")
        if self.mlp_tile is not None and self.tiled_mlp is False:
            raise ValueError("--mlp-tile sets the tiled MLP's tile: it goes with --tiled-mlp (or with --tiled-mlp left "
                             "open), not with --no-tiled-mlp")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be at least 1, got {self.layers}")
        if self.cp and self.dp and self.cp * self.dp != self.gpus:
            raise ValueError(f"--cp {self.cp} x --dp {self.dp} = {self.cp * self.dp} must equal --gpus {self.gpus}")

    @property
    def capacity_gib(self) -> float:
        if self.memory_gib is not None:
            return self.memory_gib
        if self.gpu == "cpu":  # local ranks share this machine's memory
            return machine_memory_gib() / self.gpus
        return device(self.gpu).memory_gib

    @property
    def dev(self):
        return device(self.gpu, self.precision)


@dataclass
class Plan:
    request: PlanRequest
    shape: ModelShape
    candidates: list[Candidate]
    best: Candidate | None
    suggestions: list[str] = field(default_factory=list)
    reason: str = ""  # why the recommended strategy (shown by `longdoc plan`)

    @property
    def closest(self) -> Candidate:
        return min(self.candidates, key=lambda c: c.memory.total)

    def to_dict(self) -> dict:
        sh = self.shape
        return {
            "request": dataclasses.asdict(self.request),
            "model": {"name": sh.name, "params": sh.params.total, "layers": sh.layers, "hidden": sh.hidden,
                      "intermediate": sh.intermediate, "heads": sh.heads, "kv_heads": sh.kv_heads,
                      "head_dim": sh.head_dim, "vocab": sh.vocab, "tied": sh.tied,
                      "mixers": [sh.mixer(j) for j in range(sh.layers)], "mlps": [sh.mlp(j) for j in range(sh.layers)]},
            "device": dataclasses.asdict(self.request.dev), "precision": self.request.precision,
            "capacity_gib": self.request.capacity_gib,
            "assumptions": dataclasses.asdict(Assumptions()),
            "fits": self.best is not None,
            "recommended": self.best.to_dict() if self.best else None,
            "reason": self.reason,
            "closest": None if self.best else self.closest.to_dict(),
            "suggestions": self.suggestions,
            "candidates": [c.to_dict() for c in self.candidates],
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(req: PlanRequest, shape: ModelShape, cp: int) -> list[tuple[str, int | None]]:
    """(strategy, ulysses_size) pairs open at this cp: at cp=1 one (all strategies are the same computation);
    Ulysses needs at least as many query heads as its ranks; usp every proper factor U (or the pinned one)."""
    if cp == 1 and not req.strategy:
        return [("ring", None)]
    out: list[tuple[str, int | None]] = []
    for st in [req.strategy] if req.strategy else registry.names():
        out += [(st, u) for u in registry.get(st).factorings(cp, shape.heads, req.ulysses_size)]
    if req.strategy and not out:
        raise ValueError(f"--strategy {req.strategy} is open at no cp here: Ulysses needs as many query heads as its "
                         f"ranks ({shape.heads} heads), and usp a factor 1 < U < cp; pin --cp or --ulysses-size")
    return out


def _memory_options(req: PlanRequest) -> list[tuple[bool, bool, bool, bool | None]]:
    """(checkpointing, offload, tiled MLP, fsdp) combinations open to the request."""
    gpu = device(req.gpu).is_gpu
    acs = [req.checkpointing] if req.checkpointing is not None else [False, True]
    tiles = [req.tiled_mlp] if req.tiled_mlp is not None else [False, True]
    # FSDP: a GPU's default is the trainer's (FSDP2 for full fine-tuning); on CPU parallelism.fsdp is opt-in: both
    fsdps: list[bool | None] = [req.fsdp] if req.fsdp is not None or gpu or req.lora or req.gpus == 1 \
        else [False, True]
    out = []
    for ac in acs:
        # offload helps only where the host is not the device; pinned on, it is planned as asked
        offs = [req.offload] if req.offload is not None else [False, True] if gpu and ac else [False]
        out += [(ac, off, tile, fs) for off in offs if ac or not off for tile in tiles for fs in fsdps]
    return out


def _setups(req: PlanRequest, shape: ModelShape) -> list[Setup]:
    cps = [req.cp] if req.cp else [req.gpus // req.dp] if req.dp else divisors(req.gpus)
    options = _memory_options(req)
    out = []
    for cp in cps:
        layouts = _layouts(req, shape, cp) if not (req.strategy and req.cp is None) else \
            _open_layouts(req, shape, cp)
        out += [Setup(shape=shape, seq_len=req.seq_len, cp=cp, dp=req.gpus // cp, micro_batch=req.micro_batch,
                      strategy=st, ulysses_size=u, checkpointing=ac,
                      loss_chunk=(req.loss_chunk or loss_chunk_tokens(shape.vocab)) if req.chunked_loss else None,
                      loss_tokens=req.loss_tokens,
                      lora=req.lora, device=req.gpu, offload=off, tiled_mlp=tile,
                      mlp_tile=req.mlp_tile if tile else None, fsdp=fs, precision=req.precision)
                for st, u in layouts for ac, off, tile, fs in options]
    if not out:
        raise ValueError(f"--strategy {req.strategy} is open at no cp dividing --gpus {req.gpus}: Ulysses needs as "
                         f"many query heads as its ranks ({shape.heads}), usp a factor 1 < U < cp")
    return out


def _open_layouts(req: PlanRequest, shape: ModelShape, cp: int) -> list[tuple[str, int | None]]:
    """A pinned strategy without a pinned cp: the cps where it cannot run are skipped, not refused."""
    try:
        return _layouts(req, shape, cp)
    except ValueError:
        return []


def evaluate(req: PlanRequest, shape: ModelShape | None = None) -> Plan:
    shape = shape or model_shape(req.model)
    if req.layers is not None:
        shape = shape.with_layers(req.layers)
    cands = []
    for s in _setups(req, shape):
        cands.append(Candidate(setup=s, memory=estimate(s), time=estimate_time(s, req.interconnect),
                               capacity_gib=req.capacity_gib))
    best = choose(cands)
    return Plan(request=req, shape=shape, candidates=cands, best=best, reason=explain(cands, best))


def plan(req: PlanRequest) -> Plan:
    """Estimate every open configuration, recommend one, and say what to change when none fits."""
    result = evaluate(req)
    if result.best is None:
        result.suggestions = _suggestions(req, result)
    return result


def _fits_with(req: PlanRequest, shape: ModelShape, **changes) -> Candidate | None:
    try:
        return evaluate(dataclasses.replace(req, **changes), shape).best
    except ValueError:
        return None


def _suggestions(req: PlanRequest, result: Plan) -> list[str]:
    shape, out = result.shape, []
    need = result.closest.memory.total_gib
    out.append(f"the smallest configuration ({result.closest.describe()}) needs {need:.1f} GiB per GPU, "
               f"{need - req.capacity_gib:.1f} GiB more than the {req.capacity_gib:.1f} GiB available")
    options = (("--checkpointing", {"checkpointing": True}, req.checkpointing is False),
               ("the chunked loss (drop --no-chunked-loss)", {"chunked_loss": True}, not req.chunked_loss),
               ("--lora", {"lora": True}, not req.lora),
               ("--offload", {"offload": None}, req.offload is False and device(req.gpu).is_gpu),
               ("--tiled-mlp", {"tiled_mlp": None}, req.tiled_mlp is False),
               ("--fsdp", {"fsdp": None}, req.fsdp is False and not req.lora),
               ("without --cp/--dp/--strategy", {"cp": None, "dp": None, "strategy": None},
                bool(req.cp or req.dp or req.strategy)))
    for flag, change, applies in options:
        best = _fits_with(req, shape, **change) if applies else None
        if best:
            out.append(f"fits with {flag}: {best.describe()}, {best.memory.total_gib:.1f} GiB per GPU")
    together = [(f, c) for f, c, applies in options if applies and f != "--lora"]
    if len(together) > 1 and len(out) == 1:  # no single change is enough: all of them at once?
        best = _fits_with(req, shape, **{k: v for _, c in together for k, v in c.items()})
        if best:
            out.append(f"fits with {' and '.join(f for f, _ in together)}: {best.describe()}, "
                       f"{best.memory.total_gib:.1f} GiB per GPU")
    gpus = req.gpus
    while gpus < 4096:
        gpus *= 2
        best = _fits_with(req, shape, gpus=gpus, cp=None, dp=None)
        if best:
            out.append(f"fits on {gpus} GPUs: {best.describe()}, {best.memory.total_gib:.1f} GiB per GPU")
            break
    for bigger in ("h200",):
        if req.gpu != bigger and device(bigger).memory_gib > req.capacity_gib and req.memory_gib is None:
            best = _fits_with(req, shape, gpu=bigger, precision=None)  # a GPU computes in bf16
            if best:
                out.append(f"fits on {req.gpus} x {device(bigger).name}: {best.describe()}, "
                           f"{best.memory.total_gib:.1f} GiB per GPU")
    longest = longest_fitting(req, shape)
    if longest:
        out.append(f"as asked, sequences up to {longest:,} tokens fit on {req.gpus} GPUs")
    else:
        state = sum(t.bytes for t in result.closest.memory.terms if t.category in ("weights", "optimizer")) / GIB
        out.append(f"no sequence length fits as asked: weights and AdamW state alone take {state:.1f} GiB per GPU "
                   f"here (full fine-tuning needs 16 bytes per parameter, sharded over the GPUs by FSDP2)")
    return out


def longest_fitting(req: PlanRequest, shape: ModelShape | None = None, step: int = 1024) -> int:
    """The longest sequence (a multiple of `step`) for which some open configuration fits, or 0."""
    shape = shape or model_shape(req.model)
    lo, hi = 0, max(step, req.seq_len // step * step)
    if _fits_with(req, shape, seq_len=hi):
        return hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if _fits_with(req, shape, seq_len=mid) else (lo, mid)
    return lo
