"""longdoc's own launcher (longdoc.runtime.spawn: eval, verify, bench ranks) runs its ranks with glibc returning freed
memory at once, as `longdoc train` does: a rank's resident size follows its live tensors (issue 28 item 5)."""

from __future__ import annotations


def _rss_after_free(rank: int, world_size: int) -> tuple[int, int]:
    import psutil
    import torch

    proc = psutil.Process()
    warm = torch.empty(4 << 20, dtype=torch.uint8)
    warm.fill_(1)
    del warm  # under glibc's defaults this raises its mmap threshold past 4 MiB: later 4 MiB blocks stay in the heap
    base = proc.memory_info().rss
    blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MiB
    held = proc.memory_info().rss - base
    del blocks
    return held >> 20, (proc.memory_info().rss - base) >> 20


def test_spawned_ranks_give_freed_memory_back():
    from longdoc.runtime.spawn import run_local

    for held, kept in run_local(2, _rss_after_free):
        assert held >= 200 and kept <= 32, (held, kept)
