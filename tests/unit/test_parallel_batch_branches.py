"""cp.shard_batch with preference pairs (`branches`): each pair is a document laid out per document, rejected's
positions continue from its prompt, no loss from chosen into rejected, and the pairs travel as longdoc_branches;
malformed batches are refused by name. One process plays every rank (FakeCP)."""

from __future__ import annotations

import pytest
import torch

from longdoc.hf import pairs
from longdoc.parallel import batch_branches
from longdoc.parallel.batch import count_loss_tokens, shard_batch
from longdoc.parallel.layout import Branches, Packed
from tests.support.fake_cp import FakeCP

SPANS = ((0, 3, 6, 9), (9, 10, 12, 13))  # 14 real tokens: one after the last pair


def _batch(**extra) -> dict:
    ids = torch.arange(100, 114).view(1, -1)
    return {"input_ids": ids, "labels": ids.clone(), "branches": [Branches(SPANS)], **extra}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_rows_of_pairs_are_documents_with_sibling_positions(size):
    full_pos = Branches(SPANS).position_ids(14)
    assert full_pos.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 0, 1, 2, 1, 0]
    docs = Packed((9, 4, 1))
    for rank in range(size):
        cp = FakeCP(rank, size)
        local = shard_batch(_batch(), cp)
        pack = docs.pad_to(cp.multiple) if docs.seq_len % cp.multiple else docs
        pad = pack.seq_len - 14
        full_ids = torch.cat([torch.arange(100, 114), torch.zeros(pad, dtype=torch.long)])
        assert torch.equal(local["input_ids"][0], cp.shard(full_ids, 0, documents=pack))
        want_pos = torch.cat([full_pos, torch.arange(pad)])
        assert torch.equal(local["position_ids"][0], cp.shard(want_pos, 0, documents=pack))
        targets = torch.cat([torch.arange(101, 114), torch.full((pad + 1,), -100)])
        targets[[5, 8, 11, 12]] = -100  # chosen's last tokens, and the pairs' last tokens
        assert torch.equal(local["shift_labels"][0], cp.shard(targets, 0, documents=pack))
        assert int(local["num_items_in_batch"]) == 9
        assert batch_branches.decode(local[batch_branches.BRANCHES]) == (Branches(SPANS),)
    assert count_loss_tokens(_batch()) == 9


def test_given_position_ids_must_be_the_pairs():
    good = Branches(SPANS).position_ids(14)[None]
    shard_batch(_batch(position_ids=good), FakeCP(0, 2))
    with pytest.raises(ValueError, match="not those of its branches"):
        shard_batch(_batch(position_ids=torch.arange(14)[None]), FakeCP(0, 2))


@pytest.mark.parametrize("extra, needle", [
    ({"branches": [Branches(((0, 1, 2, 20),))]}, "past its 14 real tokens"),
    ({"branches": [None, None]}, "one entry per row"),
    ({"branches": "x"}, "one longdoc Branches for every row"),
    ({"attention_mask": torch.tensor([[0] + [1] * 13])}, "left padding"),
])
def test_malformed_branches_are_refused_by_name(extra, needle):
    with pytest.raises(ValueError, match=needle):
        shard_batch(_batch(**extra), FakeCP(0, 2))


def test_rows_with_and_without_pairs_and_right_padding():
    ids = torch.arange(28).view(2, 14)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, 12:] = 0
    local = shard_batch({"input_ids": ids, "attention_mask": mask, "branches": [Branches(((1, 4, 8, 12),)), None]},
                        FakeCP(0, 1))
    assert local["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 0, 1], list(range(14))]
    assert batch_branches.decode(local[batch_branches.BRANCHES]) == (Branches(((1, 4, 8, 12),)), None)


def test_the_pre_hook_reads_pairs_that_fit_the_documents_only():
    t = batch_branches.encode([Branches(SPANS), None])
    assert pairs.read(t, [Packed((9, 4, 1)), Packed((14,))]) == (Branches(SPANS), None)
    assert pairs.read(batch_branches.encode([None]), [Packed((14,))]) is None
    with pytest.raises(ValueError, match="not one document"):
        pairs.read(t, [Packed((14,)), Packed((14,))])
    with pytest.raises(ValueError, match="rows for a batch"):
        pairs.read(t, [Packed((9, 4, 1))])
    with pytest.raises(ValueError, match="integer tensor"):
        pairs.read(t.float(), [Packed((9, 4, 1)), Packed((14,))])
