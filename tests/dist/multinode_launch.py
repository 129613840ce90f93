"""`longdoc` as one rank of a two-"node" launch, recording where the rank sits (tests only).

    torchrun --nnodes 2 --node-rank K ... -m tests.dist.multinode_launch RECORD_DIR STALL_STEP train RECIPE k=v ...

Each rank writes RECORD_DIR/rank-R.json once the training world exists: its node (the launcher's GROUP_RANK,
which torchrun and `accelerate launch` set from --node-rank / --machine_rank), its local rank, and the global
ranks of its CP group and, under usp, of its Ulysses and ring groups, read back from torch.distributed (so a
test checks the real groups, not longdoc's formula for them). With STALL_STEP > 0 the ranks of node 1 stop at
the start of optimizer step STALL_STEP (after the previous steps and their checkpoints), write
RECORD_DIR/stalled-R and sleep, so a test can SIGKILL that node at a known point.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _ranks(group) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def main() -> int:
    record, stall, *argv = sys.argv[1:]
    from longdoc.train import loop
    from longdoc.train import world as world_mod

    start = world_mod.start

    def recording_start(*args, **kwargs):
        w = start(*args, **kwargs)
        cp = w.cp
        info = {"rank": w.rank, "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                "cp": _ranks(cp.group), "ulysses": _ranks(cp._ulysses_group),
                "ring": _ranks(cp._outer_ring.group) if cp._outer_ring is not None else None}
        Path(record, f"rank-{w.rank}.json").write_text(json.dumps(info))
        return w

    world_mod.start = loop.start = recording_start  # the loop imported it by name
    if int(stall) > 0 and os.environ["GROUP_RANK"] == "1":
        from longdoc.train.loss import LossModel

        forward, calls = LossModel.forward, {"n": 0}

        def stalling(self, *args, **kwargs):
            if not kwargs.get("probe"):  # the start-up logits check is not a step
                calls["n"] += 1
                if calls["n"] == int(stall):  # micro-batch 1 of step STALL_STEP (one micro-batch per step)
                    Path(record, f"stalled-{os.environ['RANK']}").write_text(repr(time.time()))
                    time.sleep(3600)
            return forward(self, *args, **kwargs)

        LossModel.forward = stalling
    from longdoc.cli import main as longdoc_main

    return longdoc_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
