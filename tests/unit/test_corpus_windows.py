"""Pure token layout: windows over long documents, packing, QA windows around the evidence."""

from __future__ import annotations

import random

import pytest

from longdoc.corpus.windows import IGNORE, evidence_pieces, pack_rows, pretrain_rows, qa_turns_row, split_windows


@pytest.mark.parametrize("n,target,overlap", [(10, 16, 4), (16, 16, 4), (17, 16, 4), (100, 16, 0), (1000, 64, 63),
                                              (257, 32, 8)])
def test_windows_cover_every_token_once(n, target, overlap):
    ids = list(range(n))
    rows = pretrain_rows(ids, target, overlap, "d", "f:1")
    scored = []
    for row in rows:
        assert len(row["input_ids"]) == min(n, target)
        start = row["token_starts"][0]
        assert row["input_ids"] == ids[start:start + len(row["input_ids"])]
        assert row["position_ids"] == list(range(len(row["input_ids"])))
        assert row["cu_seqlens"] == [0, len(row["input_ids"])]
        scored += [x for x in row["labels"] if x != IGNORE]
    assert scored == ids, "each token is a label exactly once, in order"
    for a, b in zip(rows, rows[1:]):
        assert a["token_starts"][0] + target - b["token_starts"][0] >= overlap


def test_bad_overlap_names_the_range():
    with pytest.raises(ValueError, match=r"overlap must be in \[0, target\)"):
        split_windows(100, 16, 16)


def test_packing_restarts_positions_and_masks_boundaries():
    rows = [pretrain_rows(list(range(100 * k, 100 * k + n)), 16, 4, f"d{k}", f"f:{k}")[0]
            for k, n in enumerate([5, 6, 16, 3, 9, 7])]
    packed = pack_rows(rows, 16)
    assert [r["cu_seqlens"] for r in packed] == [[0, 5, 11], [0, 16], [0, 3, 12], [0, 7]]
    first = packed[0]
    assert first["position_ids"] == list(range(5)) + list(range(6))
    assert first["labels"][5] == IGNORE and first["labels"][6] == 101  # no prediction across documents
    assert first["doc_ids"] == ["d0", "d1"] and first["sources"] == ["f:0", "f:1"]
    assert all(len(r["input_ids"]) <= 16 for r in packed)
    assert sum(len(r["input_ids"]) for r in packed) == 46


def test_evidence_window_contains_the_spans_at_varied_offsets():
    starts = set()
    for seed in range(30):
        ((a, b),) = evidence_pieces(10_000, 500, [(4000, 4010), (4200, 4250)], random.Random(seed), 3)
        assert b - a == 500 and a <= 4000 and b >= 4250
        starts.add(a)
    assert len(starts) > 5, "evidence should not sit at one fixed depth of the window"


def test_far_apart_evidence_gives_pieces_in_order():
    pieces = evidence_pieces(100_000, 1000, [(90_000, 90_020), (100, 130)], random.Random(0), 4)
    assert len(pieces) == 2 and pieces[0][0] <= 100 and pieces[0][1] >= 130
    assert pieces[1][0] <= 90_000 and pieces[1][1] >= 90_020
    assert sum(b - a for a, b in pieces) + 4 <= 1000
    ids, labels = qa_turns_row([1], list(range(100_000)), pieces, [-1, -2, -3, -4], [([7, 8], [42, 43])])
    assert ids[-2:] == [42, 43] and labels[-2:] == [42, 43] and set(labels[:-2]) == {IGNORE}
    assert len(ids) <= 1 + 1000 + 2 + 2


def test_evidence_that_cannot_fit_is_an_error():
    with pytest.raises(ValueError, match="raise --target-tokens"):
        evidence_pieces(10_000, 50, [(0, 40), (5000, 5040)], random.Random(0), 4)
    with pytest.raises(ValueError, match="no room for the document"):
        evidence_pieces(10_000, -5, [(0, 4)], random.Random(0), 4)
