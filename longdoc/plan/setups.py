"""What the memory model reads and returns: one training configuration (Setup), the terms of each phase of its
step, and the estimate built from them (`longdoc.plan.memory.estimate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from longdoc.parallel import strategy as registry
from longdoc.parallel.api import check_strategy
from longdoc.parallel.layout import Layout, check_layout, num_chunks, round_up
from longdoc.plan import strategies
from longdoc.plan.activations import LORA_TARGETS
from longdoc.plan.hardware import GIB, Device, Precision, check_precision, device
from longdoc.plan.shapes import ModelShape, lora_params_per_layer

CATEGORIES = ("weights", "grads", "optimizer", "activations", "loss", "comm_buffers", "fsdp_buffers", "runtime",
              "slack")


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training configuration on one kind of device."""

    shape: ModelShape
    seq_len: int
    cp: int = 1
    dp: int = 1
    micro_batch: int = 1
    strategy: str = "ring"
    ulysses_size: int | None = None  # usp only: ranks per Ulysses group (a divisor of cp); cp = ring x Ulysses
    layout: Layout = "zigzag"
    checkpointing: bool = True
    loss_chunk: int | None = 1024  # None: no chunking (the whole local sequence's logits at once)
    # tokens of a sequence that carry a label (None: all, as in pretraining; QA rows: the answers). The chunked
    # loss builds logits for those rows only; under zigzag they may all sit on one rank (a row's answers at its
    # end land on rank 0), so a rank is planned with min(N, loss_tokens) of them
    loss_tokens: int | None = None
    lora: bool = False
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS
    device: str = "h100"
    precision: Precision | None = None  # None: the device's own (bf16 on GPUs, fp32 on "cpu"); "bf16" on a CPU is
    #                                     autocast over fp32 weights (train.mixed_precision: bf16)
    fsdp: bool | None = None  # None: the trainer's choice (FSDP2 for full fine-tuning on GPU)
    ddp: bool | None = None  # None: DDP when several ranks and no FSDP. Under a launcher Accelerate wraps even
    #                          a single process in DDP (its gradient buckets included), so CPU runs pass True.
    steps: int | None = None  # optimizer steps of the run (None: a long run). DDP rebuilds its gradient buckets in
    #                           the 2nd step, so they are resident at the peak from the 3rd step on only
    offload: bool = False  # parallelism.offload_checkpoints: layer checkpoints in (pinned) host memory, fetched one
    #                        layer ahead of the recompute (GPUs; on a CPU the host is the device and nothing moves)
    tiled_mlp: bool = False  # parallelism.tiled_mlp: the MLP over token tiles with recompute (longdoc.hf.tiled_mlp)
    mlp_tile: int | None = None  # tokens per MLP tile (None: the hidden size, parallelism.mlp_tile_tokens' default)

    def __post_init__(self):
        check_precision(self.precision)
        device(self.device, self.precision)
        check_strategy(self.strategy)
        check_layout(self.layout)
        if min(self.seq_len, self.cp, self.dp, self.micro_batch) < 1:
            raise ValueError("seq_len, cp, dp and micro_batch must be positive")
        if registry.get(self.strategy).factored != (self.ulysses_size is not None):
            factored = " or ".join(repr(n) for n in registry.names() if registry.get(n).factored)
            raise ValueError(f"ulysses_size goes with strategy {factored} (and only with it); got "
                             f"{self.ulysses_size!r} with {self.strategy!r}")
        strategies.check_heads(self.strategy, self.cp, self.ulysses_size, self.shape.heads)
        if self.loss_chunk is not None and self.loss_chunk < 1:
            raise ValueError("loss_chunk must be positive (or None for no chunking)")
        if self.loss_tokens is not None and self.loss_tokens < 1:
            raise ValueError("loss_tokens must be positive (or None: every token has a label)")
        if self.offload and not self.checkpointing:
            raise ValueError("offload moves the layer checkpoints to host memory, so it needs checkpointing")
        if self.mlp_tile is not None and self.mlp_tile < 1:
            raise ValueError("mlp_tile must be positive (or None: the hidden size)")

    @property
    def dev(self) -> Device:
        return device(self.device, self.precision)

    @property
    def c(self) -> int:
        return self.dev.compute_bytes

    @property
    def world(self) -> int:
        return self.cp * self.dp

    @property
    def uses_fsdp(self) -> bool:
        if self.fsdp is not None:
            return self.fsdp
        return self.dev.is_gpu and not self.lora and self.world > 1

    @property
    def shards(self) -> int:
        return self.world if self.uses_fsdp else 1

    @property
    def uses_ddp(self) -> bool:
        if self.ddp is not None:
            return self.ddp and not self.uses_fsdp
        return self.world > 1 and not self.uses_fsdp

    @property
    def ddp_buckets(self) -> bool:
        """DDP's flat gradient buckets (P_t*4) are resident at the peak: DDP, and a run of 3 steps or more."""
        return self.uses_ddp and (self.steps is None or self.steps >= 3)

    @property
    def padded_len(self) -> int:
        return round_up(self.seq_len, num_chunks(self.layout, self.cp))

    @property
    def tokens(self) -> int:
        """N: tokens each rank holds."""
        return self.micro_batch * self.padded_len // self.cp

    @property
    def offloads(self) -> bool:
        """Checkpoints leave the device: offload on a GPU (a CPU's host memory is its device memory)."""
        return self.offload and self.dev.is_gpu

    @property
    def mlp_tokens(self) -> int:
        """Tokens the MLP's intermediate tensors span at once: one tile when tiled, else all N."""
        return min(self.tokens, self.mlp_tile or self.shape.hidden) if self.tiled_mlp else self.tokens

    @property
    def chunk(self) -> int:
        return self.tokens if self.loss_chunk is None else min(self.loss_chunk, self.logit_rows)

    @property
    def logit_rows(self) -> int:
        """Rows of logits a rank computes: its labelled tokens with the chunked loss, else all N."""
        if self.loss_chunk is None or self.loss_tokens is None:
            return self.tokens
        return min(self.tokens, self.loss_tokens * self.micro_batch)

    @property
    def trainable(self) -> int:
        s = self.shape
        if self.lora:
            return s.layers * lora_params_per_layer(s, self.lora_rank, self.lora_targets)
        return s.params.total


@dataclass(frozen=True)
class Term:
    """One addend of a phase: what it is, its category, the formula with the numbers put in, bytes."""

    label: str
    category: str
    formula: str
    bytes: float


@dataclass
class MemoryEstimate:
    setup: Setup
    phases: dict[str, list[Term]]  # phase -> the terms live at its peak
    peak_phase: str
    notes: list[str] = field(default_factory=list)

    def phase_total(self, phase: str) -> float:
        return sum(t.bytes for t in self.phases[phase])

    @property
    def terms(self) -> list[Term]:
        return self.phases[self.peak_phase]

    @property
    def breakdown(self) -> dict[str, float]:
        """Category -> bytes at the peak phase."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for t in self.terms:
            out[t.category] += t.bytes
        return out

    @property
    def total(self) -> float:
        return self.phase_total(self.peak_phase)

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    @property
    def allocator_gib(self) -> float:
        """Everything but the runtime: what a caching allocator reports as reserved (torch.cuda)."""
        return (self.total - self.breakdown["runtime"]) / GIB
