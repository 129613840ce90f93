"""Where one row's tokens are under CP, for recurrences: every rank's pieces and the state resets.

A *piece* is a run of consecutive global positions of ONE document held by one rank. The zigzag layout gives
each rank two pieces of a plain row (chunks r and 2N-1-r), the contiguous layout one; a packed row (per-document
zigzag, layout.Packed) gives each rank pieces of every document. A recurrent state resets to zero at every
document start, so a piece never crosses one (runs are split there). Everything here is a pure function of the
layout, the world size and the row's documents, identical on every rank.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from longdoc.parallel import layout as layouts


@dataclass(frozen=True)
class Piece:
    """One piece: global [start, start + length), at local offset `offset` of its rank's tokens, in the
    document that starts at global position `doc`."""

    start: int
    length: int
    offset: int
    doc: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Segments:
    """One row under CP: `runs[r]` = rank r's runs (global start, length) in local order; `starts` = the
    global positions where the state resets (document starts, always 0 first), sorted."""

    runs: tuple[tuple[layouts.Run, ...], ...]
    starts: tuple[int, ...] = (0,)

    @classmethod
    def of(cls, layout: str, world_size: int, seq_len: int, documents: layouts.Packed | None = None,
           resets: tuple[int, ...] = ()) -> Segments:
        """The segments of a row of `seq_len` tokens sharded by `layout` (with `documents`, a packed row: its
        document starts reset the state). `resets`: more reset points (e.g. the padding after a prompt).
        Memoised: every recurrent layer of a forward asks for the same rows, and gets the same object (whose
        pieces are then computed once)."""
        return _of(cls, layout, world_size, seq_len, documents, tuple(resets))

    @property
    def world_size(self) -> int:
        return len(self.runs)

    @property
    def seq_len(self) -> int:
        return sum(n for rank_runs in self.runs for _, n in rank_runs)

    def doc_of(self, position: int) -> int:
        """The start of the document holding global `position`."""
        return self.starts[bisect.bisect_right(self.starts, position) - 1]

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """Rank `rank`'s pieces in local order (its runs cut at document starts)."""
        return self._pieces[rank]

    def all_pieces(self) -> tuple[tuple[Piece, ...], ...]:
        return self._pieces

    @functools.cached_property
    def _pieces(self) -> tuple[tuple[Piece, ...], ...]:
        # Each run's cuts are the starts strictly inside it, found by bisection: O((runs + pieces) log starts),
        # where testing every start against every run took seconds at a thousand documents. (cached_property
        # writes the instance __dict__ directly, so it works on the frozen dataclass.)
        starts = self.starts
        everyone = []
        for rank_runs in self.runs:
            out, offset = [], 0
            for start, length in rank_runs:
                end = start + length
                first = bisect.bisect_right(starts, start)  # the first start after the run's own
                cuts = starts[first:bisect.bisect_left(starts, end, first)]
                doc = starts[first - 1]  # the document holding `start` (starts[0] == 0)
                for a, b in zip((start, *cuts), (*cuts, end)):
                    out.append(Piece(a, b - a, offset + a - start, doc if a == start else a))
                offset += length
            everyone.append(tuple(out))
        return tuple(everyone)


@functools.lru_cache(maxsize=32)
def _of(cls, layout: str, world_size: int, seq_len: int, documents: layouts.Packed | None,
        resets: tuple[int, ...]) -> Segments:
    runs = tuple(layouts.runs(layout, r, world_size, seq_len, documents) for r in range(world_size))
    starts = set(documents.starts()[:-1]) if documents is not None else {0}
    starts.update(p for p in resets if 0 < p < seq_len)
    return cls(runs, tuple(sorted(starts | {0})))


def by_row(segs: Segments | Sequence[Segments], batch: int) -> list[tuple[slice, Segments]]:
    """(batch rows, their Segments): all rows at once when they share one layout, else one row at a time (rows
    packed differently are laid out differently: every rank loops over them alike)."""
    if isinstance(segs, Segments):
        return [(slice(0, batch), segs)]
    return [(slice(b, b + 1), s) for b, s in enumerate(segs)]
