"""Run reporting: a JSONL tracker for Accelerate, peak memory per step, the progress bar, the loss plot.

One `accelerator.log(values, step)` call feeds TensorBoard and `OUTPUT/metrics.jsonl`; rank 0 shows a
tqdm bar with loss, tokens/s, step time and peak memory. `plot_loss` draws OUTPUT/loss.png at the end.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch
from accelerate.tracking import GeneralTracker

from longdoc.runtime.budgets import return_freed_memory  # noqa: F401  (re-exported: the trainer's setting)


class JSONLTracker(GeneralTracker):
    """Accelerate tracker writing one JSON object per logged step (flushed: a crash loses nothing)."""

    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, path: str | Path, resume_step: int | None = None):
        super().__init__()
        self.path, self.resume_step = Path(path), resume_step
        self._f = None

    def start(self):
        # Accelerate calls start() on the main process only: no other rank touches the file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_step is None:
            self.path.write_text("")
        else:
            truncate_after(self.path, self.resume_step)
        self._f = open(self.path, "a")

    @property
    def tracker(self):
        return self._f

    def store_init_configuration(self, values: dict):
        pass  # the recipe is saved as OUTPUT/recipe.yaml

    def log(self, values: dict, step: int | None = None, **kwargs):
        self._f.write(json.dumps({"step": step, **values}) + "\n")
        self._f.flush()

    def finish(self):
        if self._f is not None:
            self._f.close()


def truncate_after(path: Path, step: int) -> None:
    """Drop records after `step` (a resumed run re-logs them; the file stays one trajectory)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            break  # a line cut by a crash: everything after it is suspect
    path.write_text("".join(k + "\n" for k in kept))


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


class PeakMemory:
    """Peak memory of this process during a step: CUDA allocator peak, or CPU peak RSS.

    On Linux, writing "5" to /proc/self/clear_refs resets the kernel's peak-RSS counter (VmHWM), so the
    CPU figure is per step rather than since process start.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._can_reset = os.path.exists("/proc/self/clear_refs")

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._can_reset:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._can_reset = False

    def peak_gb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Progress:
    """Rank-0 tqdm bar; other ranks and `enabled=False` get a no-op."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, smoothing=0.3)

    def update(self, loss: float, tokens_per_s: float, step_s: float, peak_gb: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", step_s=f"{step_s:.2f}",
                                 peak_gb=f"{peak_gb:.2f}", lr=f"{lr:.2e}", refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_loss(jsonl: str | Path, out_png: str | Path, title: str = "training loss") -> Path | None:
    """Loss (and LR) against optimizer step from the metrics JSONL; None if nothing was logged."""
    rows = [r for r in read_jsonl(jsonl) if "loss" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [r["loss"] for r in rows], marker="o" if len(rows) < 40 else None, lw=1.5, label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("token-mean cross-entropy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if all("lr" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot(steps, [r["lr"] for r in rows], color="tab:gray", lw=1, ls="--", label="lr")
        ax2.set_ylabel("learning rate", color="tab:gray")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
