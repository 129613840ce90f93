"""The sections of `longdoc bench`, in the order they run, and the names the `longest` section's options take.

A module of its own (no imports) so that the command line lists them without importing the benchmarks.
"""

from __future__ import annotations

SECTIONS: tuple[str, ...] = ("attention", "hybrid", "train", "memory", "longest", "calibration", "dsa", "kinds",
                              "gpu")

# `longdoc bench longest` (longdoc.bench.longest). Model -> (what it is, the TrainRun model, LoRA).
LONGEST_MODELS: dict[str, tuple[str, str, bool]] = {
    "135m": ("SmolLM2-135M, full fine-tuning", "135m", False),
    "135m-lora": ("SmolLM2-135M, LoRA", "135m", True),
    "hybrid": ("hybrid (SmolLM2-135M's width, Granite 4.0-H's Mamba2 + attention mix), full fine-tuning", "hybrid",
               False),
}
# Memory feature -> (what it is, the TrainRun fields it sets).
LONGEST_FEATURES: dict[str, tuple[str, dict[str, bool]]] = {
    "baseline": ("baseline: DDP replicas, untiled MLP", dict(fsdp=False, tiled_mlp=False)),
    "fsdp": ("+ FSDP", dict(fsdp=True, tiled_mlp=False)),
    "tiled": ("+ tiled MLP", dict(fsdp=False, tiled_mlp=True)),
    "all": ("all on", dict(fsdp=True, tiled_mlp=True)),
    "offload": ("all on + checkpoint offload", dict(fsdp=True, tiled_mlp=True, offload=True)),
}
# offload is left out by default: on a CPU the host is the device and nothing moves (longdoc.bench.longest)
LONGEST_DEFAULT_FEATURES: tuple[str, ...] = ("baseline", "fsdp", "tiled", "all")
