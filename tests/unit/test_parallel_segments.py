"""Segments.pieces (bisection, computed once per Segments) against the plain definition: every run cut at every
document start inside it."""

from __future__ import annotations

import random

import pytest

from longdoc.parallel import layout as layouts
from longdoc.parallel.recurrent import Segments
from longdoc.parallel.recurrent.segments import Piece


def _reference(seg: Segments, rank: int) -> tuple[Piece, ...]:
    """The definition, O(runs x starts): what Segments.pieces computed before it used bisection."""
    def doc_of(position):
        return max(p for p in seg.starts if p <= position)

    out, offset = [], 0
    for start, length in seg.runs[rank]:
        end = start + length
        cuts = [p for p in seg.starts if start < p < end]
        for a, b in zip([start, *cuts], [*cuts, end]):
            out.append(Piece(a, b - a, offset + a - start, doc_of(a)))
        offset += length
    return tuple(out)


def _rows(rng: random.Random, world: int):
    """(seq_len, documents, resets) of random rows: one document, a few, many short ones, with extra resets."""
    for n_docs, longest in ((1, 200), (3, 60), (40, 9), (200, 4)):
        docs = layouts.Packed(tuple(rng.randint(1, longest) for _ in range(n_docs))).pad_to(2 * world)
        resets = tuple(sorted(rng.sample(range(1, docs.seq_len), min(3, docs.seq_len - 1))))
        yield docs.seq_len, docs, ()
        yield docs.seq_len, docs, resets
        yield docs.seq_len, None, resets
        yield docs.seq_len, None, ()


@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", range(1, 9))
def test_pieces_are_the_runs_cut_at_every_document_start(lay, world):
    rng = random.Random(world)
    for seq_len, docs, resets in _rows(rng, world):
        seg = Segments.of(lay, world, seq_len, docs, resets=resets)
        assert seg.all_pieces() == tuple(_reference(seg, r) for r in range(world))
        for r in range(world):
            assert seg.pieces(r) == _reference(seg, r)


def test_one_forward_builds_the_segments_and_their_pieces_once():
    docs = layouts.Packed((5, 9, 2, 16))
    first = Segments.of("zigzag", 2, docs.seq_len, docs)
    pieces = first.all_pieces()
    again = Segments.of("zigzag", 2, docs.seq_len, layouts.Packed((5, 9, 2, 16)))  # equal rows, as the next layer
    assert again is first and again.all_pieces() is pieces and again.pieces(1) is pieces[1]
    assert Segments.of("zigzag", 2, docs.seq_len, docs, resets=(4,)) is not first
    assert Segments(first.runs, first.starts) == first  # the cached pieces are no field: equality, hash unchanged
    assert hash(Segments(first.runs, first.starts)) == hash(first)
