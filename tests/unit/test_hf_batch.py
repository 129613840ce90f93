"""shard_batch: labels shifted before sharding, internal padding, loss-token count, refusals.

A fake CP group of size N (pure layout functions, no processes) lets one process play every rank:
the per-rank loss shares computed from shards of full-sequence logits must add up to the mean loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.hf import shard_batch, shift_labels
from longdoc.parallel import layout
from tests.support.fake_cp import FakeCP, loss_share


@pytest.mark.parametrize("size,layout_name", [(1, "zigzag"), (2, "zigzag"), (4, "zigzag"), (3, "contiguous")])
@pytest.mark.parametrize("length", [24, 29])
def test_shares_sum_to_the_single_device_mean(size, layout_name, length):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 7:] = 0
    labels = ids.clone()
    labels[0, 3] = -100  # a user-ignored target
    logits = torch.randn(2, length, 50)
    # single device, HF convention: shift, ignore -100 and padded targets, mean over the rest
    ref_labels = labels.clone()
    ref_labels[mask == 0] = -100
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ref_labels[:, 1:].reshape(-1), ignore_index=-100)
    shares = []
    for rank in range(size):
        cp = FakeCP(rank, size, layout_name)
        local = shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, cp)
        assert local["input_ids"].shape[1] * size % cp.multiple == 0
        assert int(local["num_items_in_batch"]) == int((ref_labels[:, 1:] != -100).sum())
        assert "attention_mask" not in local
        shares.append(loss_share(logits, local, cp))
    assert torch.allclose(torch.stack(shares).sum(), ref, atol=1e-6, rtol=1e-6)


def test_local_batch_contents_zigzag():
    cp = FakeCP(1, 2)  # chunks 1 and 2 of 4
    ids = torch.arange(10, 17).unsqueeze(0)  # 7 tokens -> padded to 8
    local = shard_batch({"input_ids": ids, "labels": ids}, cp, pad_token_id=99)
    assert local["input_ids"].tolist() == [[12, 13, 14, 15]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 5]]
    # targets: next token over the FULL sequence; the last real token and the pad predict nothing
    assert local["shift_labels"].tolist() == [[13, 14, 15, 16]]
    rank0 = shard_batch({"input_ids": ids, "labels": ids}, FakeCP(0, 2), pad_token_id=99)
    assert rank0["input_ids"].tolist() == [[10, 11, 16, 99]]
    assert rank0["shift_labels"].tolist() == [[11, 12, -100, -100]]
    assert int(local["num_items_in_batch"]) == 6
    assert torch.equal(local["labels"], local["shift_labels"])


def test_shift_labels_masks_padding_and_end():
    labels = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert shift_labels(labels, mask).tolist() == [[2, 3, 4, -100], [6, -100, -100, -100]]


def test_without_labels_there_is_no_loss_input():
    local = shard_batch({"input_ids": torch.arange(8)}, longdoc.ContextParallel())
    assert set(local) == {"input_ids", "position_ids"}
    assert local["input_ids"].shape == (1, 8)  # a 1-D sequence gets a batch dimension


def test_inputs_embeds_are_sharded_and_padded():
    cp = FakeCP(0, 2)
    emb = torch.randn(1, 6, 5)
    local = shard_batch({"inputs_embeds": emb}, cp)
    assert local["inputs_embeds"].shape == (1, 4, 5)
    assert torch.equal(local["inputs_embeds"][0, :2], emb[0, :2])
    assert torch.equal(local["inputs_embeds"][0, 2:], torch.zeros(2, 5))


def test_num_items_override_and_empty_loss():
    cp = FakeCP(0, 1)
    ids = torch.arange(6).unsqueeze(0)
    assert int(shard_batch({"input_ids": ids, "labels": ids}, cp, num_items_in_batch=40)["num_items_in_batch"]) == 40
    none = torch.full_like(ids, -100)
    # no loss token at all: count 1, so the loss is 0 (not NaN)
    assert int(shard_batch({"input_ids": ids, "labels": none}, cp)["num_items_in_batch"]) == 1
    with pytest.raises(ValueError, match="num_items_in_batch must be positive"):
        shard_batch({"input_ids": ids, "labels": ids}, cp, num_items_in_batch=0)


def test_left_padding_is_rolled_to_the_right_keeping_positions():
    ids = torch.arange(1, 13).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    local = shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, FakeCP(0, 1))
    assert local["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 7, 8]]
    # every token keeps its position in the padded row; the pads (now last) continue after them
    assert local["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]
    # the pads predict nothing and are never predicted
    assert local["shift_labels"].tolist() == [[2, 3, 4, 5, 6, -100], [10, 11, 12, -100, -100, -100]]
    assert int(local["num_items_in_batch"]) == 8
    with_pos = shard_batch({"input_ids": ids, "attention_mask": mask,
                            "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5], [1, 1, 0, 1, 2, 3]])}, FakeCP(0, 1))
    assert with_pos["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]


def test_packed_rows_hf_format():
    """DataCollatorWithFlattening's output: documents keep their positions, never predict across."""
    from transformers import DataCollatorWithFlattening

    feats = [{"input_ids": list(range(10, 15))}, {"input_ids": list(range(20, 23))}, {"input_ids": [30]}]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{**f, "labels": f["input_ids"]} for f in feats])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0]]
    parts = [shard_batch(batch, FakeCP(r, 2)) for r in range(2)]
    docs = layout.Packed((5, 3, 1, 3))  # 9 tokens padded to 12 (cp.multiple 4): one padding document
    for r, local in enumerate(parts):
        assert local["cu_seq_lens_q"].tolist() == [0, 5, 8, 9, 12]
        assert torch.equal(local["input_ids"][0], docs.shard(torch.tensor([*range(10, 15), 20, 21, 22, 30, 0, 0, 0]),
                                                             0, r, 2))
        assert torch.equal(local["position_ids"][0], docs.shard(docs.position_ids(), 0, r, 2))
    full = layout.Packed.unshard(docs, [p["shift_labels"][0] for p in parts], 0)
    # a document's last token predicts nothing; the single-token document has no target at all
    assert full.tolist() == [11, 12, 13, 14, -100, 21, 22, -100, -100, -100, -100, -100]
    assert int(parts[0]["num_items_in_batch"]) == 6
    # the same row from position_ids alone, or from cu_seq_lens alone
    for only in ("position_ids", "cu_seq_lens_q"):
        alone = shard_batch({"input_ids": batch["input_ids"], only: batch[only]}, FakeCP(1, 2))
        assert torch.equal(alone["input_ids"], parts[1]["input_ids"])
        assert torch.equal(alone["position_ids"], parts[1]["position_ids"])


def test_packed_rows_refusals():
    ids = torch.ones(1, 6, dtype=torch.long)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match="neither consecutive nor packed"):
        shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 3, 0, 1, 2]])}, FakeCP(0, 2))
    with pytest.raises(ValueError, match="cu_seq_lens_q disagrees with position_ids"):
        shard_batch({"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": torch.tensor([0, 2, 6])}, FakeCP(0, 2))
    with pytest.raises(ValueError, match="packed rows .* with left padding"):
        shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 0, 1, 0, 1, 2]]),
                     "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}, FakeCP(0, 2))
    with pytest.raises(ValueError, match="increasing document boundaries"):
        shard_batch({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 4, 3, 6])}, FakeCP(0, 2))


def test_holes_in_the_mask_are_refused():
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"holes \(zeros between real tokens\)"):
        shard_batch({"input_ids": torch.ones(1, 6, dtype=torch.long), "attention_mask": mask}, FakeCP(0, 2))


def test_bad_batches_are_refused():
    cp = FakeCP(0, 2)
    ids = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown keys \['token_type_ids'\]"):
        shard_batch({"input_ids": ids, "token_type_ids": ids}, cp)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        shard_batch({"labels": ids}, cp)
    with pytest.raises(ValueError, match=r"labels has shape \(1, 5\), expected \(1, 6\)"):
        shard_batch({"input_ids": ids, "labels": ids[:, :5]}, cp)
    # plain positions are fine (many collators add them)
    shard_batch({"input_ids": ids, "position_ids": torch.arange(6).unsqueeze(0)}, cp)
    with pytest.raises(ValueError, match="the sequence is empty"):
        shard_batch({"input_ids": torch.ones(1, 0, dtype=torch.long)}, cp)


def test_count_loss_tokens_matches_shard_batch():
    from longdoc.parallel.batch import count_loss_tokens

    ids = torch.arange(1, 13).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    assert count_loss_tokens({"input_ids": ids, "labels": ids, "attention_mask": mask}) == 4 + 3
    packed = {"input_ids": ids[:1], "labels": ids[:1], "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert count_loss_tokens(packed) == 3  # 2 + 1 + 0: no target across a document's end
    assert int(shard_batch(packed, FakeCP(1, 2))["num_items_in_batch"]) == 3
