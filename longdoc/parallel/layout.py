"""Sequence layouts: which tokens of a full sequence each context-parallel rank holds.

zigzag (default for causal attention): the sequence is cut into 2N equal chunks and rank r holds
chunks r and 2N-1-r, so every rank gets the same amount of causal work.
contiguous: the sequence is cut into N chunks and rank r holds chunk r.

Pure functions of (rank, world_size); `shard` and `unshard` are exact inverses.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = get_args(Layout)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def num_chunks(layout: str, world_size: int) -> int:
    """How many equal chunks the full sequence is cut into; lengths must be a multiple of this."""
    return 2 * world_size if check_layout(layout) == "zigzag" else world_size


def chunk_ids(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """Global chunk indices held by `rank`, in local order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if check_layout(layout) == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def check_divisible(length: int, layout: str, world_size: int, what: str = "sequence length") -> None:
    multiple = num_chunks(layout, world_size)
    if length % multiple:
        padded = round_up(length, multiple)
        raise ValueError(
            f"{what} {length} is not divisible by {multiple} ({layout} layout over {world_size} ranks "
            f"needs a multiple of {multiple}); pad it to {padded}, or use cp.shard_batch, which pads internally"
        )


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full tensor `x` along `dim` (a copy, contiguous)."""
    check_divisible(x.shape[dim], layout, world_size, what=f"size {x.shape[dim]} of dim {dim}")
    chunks = x.chunk(num_chunks(layout, world_size), dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(layout, rank, world_size)], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of `shard`: `parts[r]` is rank r's local tensor; returns the full tensor."""
    world_size = len(parts)
    n = num_chunks(layout, world_size)
    chunks: list[torch.Tensor | None] = [None] * n
    for rank, part in enumerate(parts):
        ids = chunk_ids(layout, rank, world_size)
        for i, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def positions(seq_len: int, rank: int, world_size: int, layout: str = "zigzag",
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (LongTensor, shape (local_len,)) of the tokens this rank holds."""
    return shard(torch.arange(seq_len, device=device), 0, rank, world_size, layout)
