"""`longdoc` under a launcher, with one fault injected (tests only; the product has no fault hooks).

    accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m tests.dist.reliability_launch \
        FAULT RANK STEP PID_DIR train RECIPE key=value ...

FAULT on rank RANK: `raise` (an exception in optimizer step STEP, 1-based), `kill` (SIGKILL of the
rank itself in step STEP), `kill-checkpoint` (SIGKILL while writing the STEP-th checkpoint: its
temporary folder exists, the state is half written); `none` runs normally. Each rank writes its pid
to PID_DIR, and the faulty rank the time of the fault (fault.time), so a test can check how fast the
others stop and that no process outlives the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def _fault(fault: str, rank: int, step: str, pid_dir: str) -> None:
    Path(pid_dir, "fault.time").write_text(repr(time.time()))
    if fault.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank} in step {step}")


def main() -> int:
    fault, bad_rank, bad_step, pid_dir, *argv = sys.argv[1:]
    from longdoc.runtime.launch import launched_world

    rank = launched_world().rank
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if fault == "kill-checkpoint" and rank == int(bad_rank):
        import torch.distributed.checkpoint as dcp

        save, saves = dcp.save, {"n": 0}

        def dying_save(*args, **kwargs):
            saves["n"] += 1
            if saves["n"] == int(bad_step):
                _fault(fault, rank, bad_step, pid_dir)
            return save(*args, **kwargs)

        dcp.save = dying_save
    elif fault != "none" and rank == int(bad_rank):
        from longdoc.train.loss import LossModel

        forward, calls = LossModel.forward, {"n": 0}

        def faulty(self, *args, **kwargs):
            if not kwargs.get("probe"):  # the start-up logits check is not a step
                calls["n"] += 1
                if calls["n"] == int(bad_step):
                    _fault(fault, rank, bad_step, pid_dir)
            return forward(self, *args, **kwargs)

        LossModel.forward = faulty
    from longdoc.cli import main as longdoc_main

    return longdoc_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
