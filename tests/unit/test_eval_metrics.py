"""SQuAD/LongBench answer metrics on hand-written cases with known answers, and the breakdowns."""

from __future__ import annotations

import pytest

from longdoc.eval import metrics


@pytest.mark.parametrize("text, expected", [
    ("The Cat sat.", "cat sat"),
    ("  An apple,  a   pear; THE end!  ", "apple pear end"),
    ("$1,250.00", "125000"),
    ("Dr. O'Neil", "dr oneil"),
    ("theory of an anthem", "theory of anthem"),  # articles only as whole words
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert metrics.normalize_answer(text) == expected


@pytest.mark.parametrize("pred, gold, em", [
    ("The patient's MRN is 27876959", "27876959", 0.0),
    ("27876959.", "27876959", 1.0),
    ("the Plaintiff", "plaintiff", 1.0),
    ("March 3, 2021", ["03/03/2021", "March 3, 2021"], 1.0),  # best over gold + aliases
    ("three", ["3", "three"], 1.0),
    ("", "anything", 0.0),
])
def test_exact_match(pred, gold, em):
    assert metrics.exact_match(pred, gold) == em


def test_token_f1_known_values():
    # pred tokens {nausea, and, vomiting, daily}, gold {nausea, and, vomiting}: P = 3/4, R = 1, F1 = 6/7.
    assert metrics.token_f1("Nausea and vomiting daily", "nausea and vomiting") == pytest.approx(6 / 7)
    # One token in common of 2 and 4: P = 1/2, R = 1/4, F1 = 1/3.
    assert metrics.token_f1("blue car", "a red car was parked") == pytest.approx(1 / 3)
    # Multiset overlap: "the the" style repeats count once per occurrence.
    assert metrics.token_f1("five five five", "five") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert metrics.token_f1("no overlap here", "entirely different") == 0.0
    assert metrics.token_f1("x", ["nothing", "x"]) == 1.0
    # Both empty after normalization (only articles): agreement; one empty: none.
    assert metrics.token_f1("the", "a") == 1.0
    assert metrics.token_f1("", "answer") == 0.0


def test_contains_answer_needs_whole_words():
    assert metrics.contains_answer("The code is 48173.", "48173") == 1.0
    assert metrics.contains_answer("The code is 481734.", "48173") == 0.0
    assert metrics.contains_answer("Nausea and vomiting.", ["vomiting", "emesis"]) == 1.0
    assert metrics.contains_answer("anything", "the") == 0.0  # an empty normalized gold never matches


def test_buckets_and_breakdown():
    assert metrics.depth_bucket(0.0) == "0.0-0.2"
    assert metrics.depth_bucket(0.39) == "0.2-0.4"
    assert metrics.depth_bucket(1.0) == "0.8-1.0"
    assert [metrics.length_bucket(n) for n in (2048, 2100, 4000, 32768, 700)] == ["2k", "2k", "4k", "32k", "700"]
    rows = [{"len": "4k", "em": 1.0, "f1": 1.0}, {"len": "32k", "em": 0.0, "f1": 0.5},
            {"len": "4k", "em": 0.0, "f1": 0.0, "nll_per_token": 2.0}]
    out = metrics.breakdown(rows, lambda r: r["len"])
    assert list(out) == ["4k", "32k"]  # numeric order, not "32k" < "4k"
    assert out["4k"] == {"n": 2, "em": 0.5, "f1": 0.5, "nll_per_token": 2.0}
    assert out["32k"]["n"] == 1 and "nll_per_token" not in out["32k"]
