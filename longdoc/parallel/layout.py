"""Sequence layouts: which tokens of a full sequence each context-parallel rank holds.

zigzag (default for causal attention): the sequence is cut into 2N equal chunks and rank r holds
chunks r and 2N-1-r, so every rank gets the same amount of causal work.
contiguous: the sequence is cut into N chunks and rank r holds chunk r.

Pure functions of (rank, world_size); `shard` and `unshard` are exact inverses.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
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


# ---- runs: a rank's tokens as contiguous pieces of the full sequence ---------------------------

Run = tuple[int, int]  # (global start, length), in local order


def runs(layout: str, rank: int, world_size: int, seq_len: int, documents: Packed | None = None) -> tuple[Run, ...]:
    """The contiguous pieces of the full sequence that `rank` holds, in local order (increasing start).

    Plain layouts cut the sequence into equal chunks; with `documents` and the zigzag layout every
    document is zigzagged on its own (see `Packed`). The contiguous layout ignores the documents.
    """
    if documents is not None and check_layout(layout) == "zigzag":
        return documents.runs(rank, world_size)
    check_divisible(seq_len, layout, world_size)
    chunk = seq_len // num_chunks(layout, world_size)
    return tuple((i * chunk, chunk) for i in chunk_ids(layout, rank, world_size))


def shard_runs(x: torch.Tensor, dim: int, pieces: tuple[Run, ...]) -> torch.Tensor:
    """The tokens of `pieces` along `dim`, concatenated in order (a copy, contiguous)."""
    return torch.cat([x.narrow(dim, start, length) for start, length in pieces], dim=dim)


def unshard_runs(parts: list[torch.Tensor], dim: int, pieces: list[tuple[Run, ...]]) -> torch.Tensor:
    """Inverse of `shard_runs`: `parts[r]` holds the tokens of `pieces[r]`; returns the full tensor."""
    located = []
    for part, rank_runs in zip(parts, pieces):
        offset = 0
        for start, length in rank_runs:
            located.append((start, part.narrow(dim, offset, length)))
            offset += length
    return torch.cat([piece for _, piece in sorted(located, key=lambda sp: sp[0])], dim=dim)


# ---- packed rows: several documents in one row, balanced over the ranks ------------------------

@dataclass(frozen=True)
class Packed:
    """A packed row: the lengths of its documents, in order, summing to the (padded) row length.

    Tokens attend only within their own document. With the zigzag layout each document is cut into
    2N equal chunks and rank r gets chunks r and 2N-1-r (per-document zigzag), so every rank gets the
    same causal work whatever the document lengths. What does not divide (the last `len % 2N`
    tokens of each document, all of a document shorter than 2N) is dealt out as one stream cut into
    N equal contiguous pieces; those tokens are few (< 2N per document), so the imbalance they add is
    small (see longdoc/bench/patterns.py). The row length must be a multiple of N only: pad it with
    `pad_to(cp.size)`, which appends one padding document (its tokens see only each other).
    Everything is a pure function of `doc_lens`, identical on every rank.
    """

    doc_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        lens = tuple(self.doc_lens)
        if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
            raise ValueError(f"documents: doc_lens must be a non-empty sequence of positive ints (one per packed "
                             f"document, in order), got {self.doc_lens!r}")
        object.__setattr__(self, "doc_lens", lens)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | Sequence[int]) -> Packed:
        """The documents of one packed row in Hugging Face's format (position_ids restarting at 0 at
        each document, as DataCollatorWithFlattening makes): a 1-D sequence or tensor of ints."""
        pos = [int(p) for p in (position_ids.tolist() if isinstance(position_ids, torch.Tensor) else position_ids)]
        if not pos or pos[0] != 0 or any(b not in (0, a + 1) for a, b in zip(pos, pos[1:])):
            raise ValueError("documents: packed position_ids must start at 0 and either go up by 1 or restart at "
                             "0 (a new document); got a row that does neither (1-D, one row of the batch)")
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        return cls(tuple(b - a for a, b in zip(starts, starts[1:])))

    @property
    def seq_len(self) -> int:
        return sum(self.doc_lens)

    def pad_to(self, multiple: int) -> Packed:
        """This row padded to a multiple of `multiple` by one extra (padding) document, if needed."""
        extra = round_up(self.seq_len, multiple) - self.seq_len
        return Packed(self.doc_lens + (extra,)) if extra else self

    def starts(self) -> tuple[int, ...]:
        """Global start of every document, plus the row length at the end."""
        out, pos = [], 0
        for n in self.doc_lens:
            out.append(pos)
            pos += n
        return (*out, pos)

    def runs(self, rank: int, world_size: int) -> tuple[Run, ...]:
        """Per-document zigzag pieces held by `rank` (see the class docstring), in increasing order."""
        return _packed_runs(self.doc_lens, world_size)[rank]

    def check(self, world_size: int) -> None:
        if self.seq_len % world_size:
            raise ValueError(f"documents: the packed row has {self.seq_len} tokens, not a multiple of the "
                             f"{world_size} CP ranks; pad it with Packed.pad_to({world_size}) (adds one "
                             f"padding document of {round_up(self.seq_len, world_size) - self.seq_len} tokens)")

    def shard(self, x: torch.Tensor, dim: int, rank: int, world_size: int, layout: str = "zigzag") -> torch.Tensor:
        """This rank's part of the full packed tensor `x` along `dim`."""
        self._check_len(x.shape[dim], world_size)
        return shard_runs(x, dim, runs(layout, rank, world_size, x.shape[dim], self))

    def unshard(self, parts: list[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
        """Inverse of `shard`: `parts[r]` is rank r's local tensor; returns the full tensor."""
        n = len(parts)
        self.check(n)
        return unshard_runs(parts, dim, [runs(layout, r, n, self.seq_len, self) for r in range(n)])

    def positions(self, rank: int, world_size: int, layout: str = "zigzag",
                  device: torch.device | str | None = None) -> torch.Tensor:
        """Global row positions (LongTensor, (local_len,)) of the tokens this rank holds."""
        return self.shard(torch.arange(self.seq_len, device=device), 0, rank, world_size, layout)

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions within each document for the full row (restart at 0 per document, as HF packs)."""
        return torch.cat([torch.arange(n, device=device) for n in self.doc_lens])

    def _check_len(self, length: int, world_size: int) -> None:
        self.check(world_size)
        if length != self.seq_len:
            raise ValueError(f"documents: the tensor has {length} tokens but doc_lens sum to {self.seq_len}; "
                             f"pass the lengths of this row's documents (padding included)")


@functools.lru_cache(maxsize=256)
def _packed_runs(doc_lens: tuple[int, ...], world_size: int) -> tuple[tuple[Run, ...], ...]:
    n_chunks = 2 * world_size
    per_rank: list[list[Run]] = [[] for _ in range(world_size)]
    tails: list[Run] = []
    start = 0
    for n in doc_lens:
        q, rem = divmod(n, n_chunks)
        if q:
            for r in range(world_size):
                per_rank[r] += [(start + r * q, q), (start + (n_chunks - 1 - r) * q, q)]
        if rem:
            tails.append((start + n_chunks * q, rem))
        start += n
    if start % world_size:
        raise ValueError(f"documents: {start} tokens are not a multiple of {world_size} ranks; use Packed.pad_to")
    # Deal the tails as one stream cut into equal contiguous pieces, so local lengths are equal.
    share = sum(n for _, n in tails) // world_size
    rank, room = 0, share
    for s, n in tails:
        while n:
            take = min(n, room)
            per_rank[rank].append((s, take))
            s, n, room = s + take, n - take, room - take
            if room == 0 and rank + 1 < world_size:
                rank, room = rank + 1, share
    return tuple(tuple(_coalesce(sorted(rs))) for rs in per_rank)


def _coalesce(pieces: list[Run]) -> list[Run]:
    """Adjacent pieces merged, so a rank holding a whole document holds it as one run."""
    out: list[Run] = []
    for s, n in pieces:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


# ---- sibling branches: preference pairs packed as [prompt | chosen | rejected] ------------------

Span = tuple[int, int, int, int]  # (prompt_start, chosen_start, rejected_start, end), row indices


@dataclass(frozen=True)
class Branches:
    """Preference pairs in one packed row, each `[prompt | chosen | rejected]`: a shared prefix, two siblings.

    spans: one (prompt_start, chosen_start, rejected_start, end) per pair, in row order, not overlapping; prompt,
    chosen and rejected hold >= 1 token each. Query i sees key j (row indices) when both lie in one pair, j <= i,
    and not (i in rejected and j in chosen): chosen sees prompt + chosen, rejected sees prompt + rejected. Each pair
    is one document of the row; tokens outside every pair form documents of their own, one per gap (`documents`).
    Rejected's position ids continue from the prompt's end (`position_ids`); masking is by row index only.
    """

    spans: tuple[Span, ...]

    def __post_init__(self) -> None:
        raw = self.spans.tolist() if isinstance(self.spans, torch.Tensor) else self.spans
        try:
            spans = tuple(tuple(s) for s in raw)
        except TypeError:
            spans = ()
        ints = all(len(s) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in s) for s in spans)
        if not spans or not ints or spans[0][0] < 0 or not self._ordered(spans):
            raise ValueError(f"branches: spans must be a non-empty sequence of (prompt_start, chosen_start, "
                             f"rejected_start, end) int tuples, one per pair, in row order, with prompt, chosen and "
                             f"rejected non-empty and pairs not overlapping; got {self.spans!r}")
        object.__setattr__(self, "spans", spans)

    @staticmethod
    def _ordered(spans: tuple[Span, ...]) -> bool:
        ends = [e for *_, e in spans]
        return all(p < c < r < e for p, c, r, e in spans) and all(e <= s[0] for e, s in zip(ends, spans[1:]))

    @property
    def end(self) -> int:
        return self.spans[-1][3]

    def documents(self, seq_len: int) -> Packed:
        """The row's documents: every pair, and every stretch of tokens outside the pairs (up to seq_len)."""
        if self.end > seq_len:
            raise ValueError(f"branches: the last pair ends at {self.end}, past the row's {seq_len} tokens")
        cuts = sorted({0, seq_len, *(x for p, _, _, e in self.spans for x in (p, e))})
        return Packed(tuple(b - a for a, b in zip(cuts, cuts[1:])))

    def check(self, documents: Packed) -> None:
        """Raise unless every pair is exactly one document of `documents` (another split would cut a pair)."""
        starts = documents.starts()
        inner = set(starts)
        for p, _, _, e in self.spans:
            if p not in inner or e not in inner or any(p < s < e for s in starts):
                raise ValueError(f"branches: the pair at tokens [{p}, {e}) is not one document of the packed row "
                                 f"(documents start at {list(starts[:8])}...); pass documents=branches.documents("
                                 f"seq_len), or none")

    def cuts(self) -> tuple[int, ...]:
        """Every pair's prompt, chosen and rejected starts and its end."""
        return tuple(x for s in self.spans for x in s)

    def position_ids(self, seq_len: int, device: torch.device | str | None = None,
                     documents: Packed | None = None) -> torch.Tensor:
        """Position ids of the full row: 0.. per document (`documents`, default `self.documents(seq_len)`), and
        rejected continuing from its prompt's end, as if chosen were not there."""
        pos = (documents or self.documents(seq_len)).position_ids(device)
        for p, c, r, e in self.spans:
            pos[r:e] = torch.arange(c - p, c - p + e - r, device=device)
        return pos
