"""Real training steps for the benchmarks and the planner's calibration: the trainer, on local gloo ranks.

    result = run_steps(TrainRun(model="tiny", cp=2, seq_len=8192))
    result.peak_gib          # the largest peak RSS of any rank over its whole life (model load included)

Each run starts fresh processes (`longdoc.runtime.spawn.run_local`), so a rank's peak resident set size
(`ru_maxrss`, never reset) is the honest memory a machine must provide for it: Python, torch,
transformers, the model load, every step. Runs use `longdoc.train.loop.train` itself, with random
tokens and nothing written but a scratch folder.

Ranks return freed memory to the OS at once (the trainer's `train.release_freed_memory`, on by default;
TrainRun.release_memory=False measures glibc's defaults, under which a training process keeps 0.5-2 GiB
of freed tensor memory that no formula predicts: `longdoc.train.metrics.return_freed_memory`).
"""

from __future__ import annotations

import resource
import tempfile
from dataclasses import asdict, dataclass, field

from longdoc.plan.hardware import PRECISIONS, Precision, cpu_precision
from longdoc.runtime.launch import set_launcher_env
from longdoc.runtime.spawn import run_local

# The benchmarks' tiny model: small enough for 32k tokens on two cores, with the real tokenizer's
# vocabulary so the loss chunks weigh what they weigh for the 135M model.
TINY = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
MODELS = {"tiny": "tiny:llama", "135m": "SmolLM2-135M-Instruct", "hybrid": "tiny:granitemoehybrid"}
# SmolLM2-135M-Instruct's shape (its config.json): a run at reduced depth (TrainRun.layers) builds this shape with
# random weights as a tiny:llama, so every per-layer and per-token byte is the 135M model's
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5)
# The benchmarks' hybrid: SmolLM2-135M's width, attention heads and MLP with Granite 4.0-H's layer mix (Mamba2 (SSD)
# in 9 layers of 10, attention in the others: hybrid_layer_types) and no experts (a dense gated MLP in every layer,
# so the planner reads its true width), random weights. Its SSD runs transformers' torch path, whose per-chunk
# intermediates grow with the chunk and the heads: 18 heads of 64 (expand 2) in chunks of 64 tokens keep them small.
HYBRID = dict(hidden_size=576, intermediate_size=1536, shared_intermediate_size=1536, num_local_experts=0,
              num_experts_per_tok=None, num_attention_heads=9, num_key_value_heads=3, head_dim=64, mamba_n_heads=18,
              mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
              tie_word_embeddings=True, max_position_embeddings=1 << 20)
HYBRID_LAYERS = 30  # full depth (as the 135M model's)


def hybrid_layer_types(layers: int) -> list[str]:
    """Granite 4.0-H's mix at `layers` deep: attention in layer 5 of every 10 (under 10 layers, in layer 5 mod
    `layers`: 2 layers are Mamba2 then attention), Mamba2 in the others."""
    return ["attention" if i % 10 == 5 % layers else "mamba" for i in range(layers)]


@dataclass(frozen=True, kw_only=True)
class TrainRun:
    model: str = "tiny"  # "tiny" (TINY above), "135m" (SmolLM2-135M-Instruct) or "hybrid" (HYBRID above)
    cp: int = 1
    seq_len: int = 4096
    steps: int = 3  # steady state from the third: optimizer states exist, DDP has rebuilt its buckets
    checkpointing: bool = True
    lora: bool = False
    loss_chunk: int = 1024
    threads: int | None = None  # per rank; None: total_threads // cp
    total_threads: int = 2
    release_memory: bool = True  # the trainer's train.release_freed_memory (False: glibc's defaults)
    # pinned in the recipe (train.mixed_precision) so the planner predicts the run that happens; the default
    # is what `longdoc plan --gpu cpu` assumes: what `auto` picks on this machine (bf16 on native-bf16 CPUs)
    precision: Precision = field(default_factory=cpu_precision)
    fsdp: bool = False  # parallelism.fsdp: weights, gradients and AdamW moments sharded over the ranks (FSDP2 on gloo)
    tiled_mlp: bool = False  # parallelism.tiled_mlp
    offload: bool = False  # parallelism.offload_checkpoints (on CPU host == device: the hooks run, nothing moves)
    layers: int | None = None  # decoder layers (None: the model's own); fewer keep long runs short

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.model == "hybrid" and self.layers is not None and self.layers < 2:
            raise ValueError(f"the hybrid model needs at least 2 layers (a Mamba2 and an attention layer), got "
                             f"layers={self.layers}")

    @property
    def rank_threads(self) -> int:
        return self.threads or max(1, self.total_threads // self.cp)

    def label(self) -> str:
        extra = ("" if self.checkpointing else " noAC") + (" LoRA" if self.lora else "")
        extra += "" if self.loss_chunk == 1024 else f" CE{self.loss_chunk}"
        extra += "" if self.release_memory else " glibc-default"
        extra += (" FSDP" if self.fsdp else "") + (" tiledMLP" if self.tiled_mlp else "")
        extra += (" offload" if self.offload else "") + ("" if self.layers is None else f" L{self.layers}")
        extra += "" if self.precision == cpu_precision() else f" {self.precision}"  # named when not the default
        tokens = f"{self.seq_len // 1024}k" if self.seq_len % 1024 == 0 else f"{self.seq_len}"
        return f"{self.model} cp{self.cp} {tokens}{extra}"

    def overrides(self) -> dict | None:
        """The config overrides of the random-init model this run builds ("tiny:<arch>"), None for SmolLM2-135M's
        own weights (the 135M model at full depth)."""
        if self.model == "tiny":
            return dict(TINY) | ({} if self.layers is None else {"num_hidden_layers": self.layers})
        if self.model == "hybrid":
            layers = self.layers or HYBRID_LAYERS
            return HYBRID | {"num_hidden_layers": layers, "layer_types": hybrid_layer_types(layers)}
        if self.layers is not None:
            return SMOLLM2_135M | {"num_hidden_layers": self.layers, "max_position_embeddings": max(8192, self.seq_len)}
        return None

    def recipe(self, output_dir: str) -> dict:
        overrides = self.overrides()
        # the 135M model at reduced depth is its shape built as a tiny:llama
        model: dict = {"name": MODELS["tiny" if self.model == "135m" and overrides else self.model]}
        if overrides is not None:
            model["overrides"] = overrides
        elif self.seq_len > 8192:  # SmolLM2's native context is 8k
            model.update(rope_type="yarn", rope_factor=float(2 ** max(0, (self.seq_len - 1).bit_length() - 13)))
        return {
            "output_dir": output_dir,
            "model": model,
            "lora": {"enabled": self.lora},
            "data": {"path": "random", "seq_len": self.seq_len, "random_size": self.steps},
            "optim": {"warmup_steps": 0},
            "train": {"steps": self.steps, "batch_size": 1, "activation_checkpointing": self.checkpointing,
                      "loss_chunk_tokens": self.loss_chunk, "release_freed_memory": self.release_memory,
                      "mixed_precision": "no" if self.precision == "fp32" else self.precision},
            "parallelism": {"cp_size": self.cp, "fsdp": self.fsdp, "tiled_mlp": self.tiled_mlp,
                            "offload_checkpoints": self.offload},
            "checkpoint": {"every": 0, "at_end": False, "export": False},
            "log": {"progress": False, "tensorboard": False, "plot": False},
        }


@dataclass
class RunResult:
    run: TrainRun
    peak_gib: float  # max over ranks of the lifetime peak RSS
    rank_peaks_gib: list[float]
    step_peaks_gib: list[float]  # per step, max over ranks (the trainer's per-step peak RSS)
    step_s: list[float]
    tokens_per_s: float  # steady state: steps after the first
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["run"] = asdict(self.run) | {"label": self.run.label()}
        return d


def _rank(rank: int, world_size: int, recipe: dict) -> dict:
    # run_local has joined the gloo group; Accelerate reads the launcher's variables.
    set_launcher_env(rank, world_size, HF_HUB_OFFLINE="1")
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    result = train(recipe_from_dict(recipe))
    return {
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB -> GiB
        "step_peaks_gib": [s.peak_gb for s in result.history],
        "step_s": [s.step_s for s in result.history],
        "losses": [s.loss for s in result.history],
        "tokens": [s.tokens for s in result.history],
    }


def run_steps(run: TrainRun, deadline: float = 3600) -> RunResult:
    """Train `run.steps` steps on `run.cp` fresh local ranks and report peak memory and speed."""
    with tempfile.TemporaryDirectory(prefix="longdoc-bench-") as tmp:
        per_rank = run_local(run.cp, _rank, run.recipe(tmp), threads=run.rank_threads,
                             deadline=deadline,
                             pg_timeout=max(600, deadline))
    steps = len(per_rank[0]["step_s"])
    step_peaks = [max(r["step_peaks_gib"][k] for r in per_rank) for k in range(steps)]
    step_s = [max(r["step_s"][k] for r in per_rank) for k in range(steps)]
    steady = list(range(1, steps)) or [0]
    tokens = sum(per_rank[0]["tokens"][k] for k in steady)
    return RunResult(run=run, peak_gib=max(r["peak_gib"] for r in per_rank),
                     rank_peaks_gib=[r["peak_gib"] for r in per_rank], step_peaks_gib=step_peaks, step_s=step_s,
                     tokens_per_s=tokens / sum(step_s[k] for k in steady), losses=per_rank[0]["losses"])
