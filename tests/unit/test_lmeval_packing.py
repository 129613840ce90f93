"""lm-eval's log-likelihood requests are packed into rows by a token budget (max_batch_tokens, default max_length),
not by count alone, and packing does not change the scores."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("lm_eval")

from longdoc.lmeval.model import LongDocLM, pack  # noqa: E402


def test_pack_keeps_order_and_both_limits():
    rng = random.Random(0)
    for _ in range(200):
        lengths = sorted((rng.randint(1, 50) for _ in range(rng.randint(0, 30))), reverse=True)
        max_items, max_tokens = rng.randint(1, 8), rng.randint(50, 120)
        rows = pack(lengths, list(range(len(lengths))), max_items, max_tokens)
        assert [i for row in rows for i in row] == list(range(len(lengths)))  # every request once, in order
        assert all(row and len(row) <= max_items and sum(lengths[i] for i in row) <= max_tokens for row in rows)
        # greedy: a row ends only when the next request would break a limit
        for row, following in zip(rows, rows[1:]):
            assert len(row) == max_items or sum(lengths[i] for i in row) + lengths[following[0]] > max_tokens
    assert pack([10, 3], ["long", "short"], 4, 5) == [["long"], ["short"]]  # longer than the budget: alone


@pytest.fixture(scope="module")
def lm():
    return LongDocLM(pretrained="tiny:llama", device="cpu", batch_size=8, max_length=64)


def _requests(seed: int) -> list[tuple[None, list[int], list[int]]]:
    rng = random.Random(seed)
    return [(None, [rng.randrange(3, 200) for _ in range(rng.randint(1, 50))],
             [rng.randrange(3, 200) for _ in range(rng.randint(1, 8))]) for _ in range(12)]


def test_no_row_exceeds_the_budget_and_the_scores_do_not_change(lm, monkeypatch):
    requests = _requests(1)
    rows, score = [], LongDocLM._score_packed

    def recording(self, chunk):
        rows.append(sum(len(inp) for _, inp, _ in chunk))
        return score(self, chunk)

    monkeypatch.setattr(LongDocLM, "_score_packed", recording)
    packed = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert max(rows) <= lm.max_batch_tokens == lm.max_length == 64
    assert len(rows) < len(requests)  # requests do share rows
    # by count alone, 8 requests of up to 64 tokens would have shared one row
    assert sum(len(c + x) - 1 for _, c, x in requests[:8]) > 64
    monkeypatch.setattr(lm, "batch", 1)
    alone = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in packed] == [g for _, g in alone]
    assert [lp for lp, _ in packed] == pytest.approx([lp for lp, _ in alone], abs=2e-4)


def test_a_budget_below_max_length_is_refused():
    with pytest.raises(ValueError, match="max_batch_tokens=32 is below max_length=64"):
        LongDocLM(pretrained="tiny:llama", device="cpu", max_length=64, max_batch_tokens=32)
