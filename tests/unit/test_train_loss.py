"""Chunked cross-entropy: equal to the model's own loss and gradients, and never holds full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.models import tiny_model
from longdoc.train.loss import ChunkStats, LogitHead, LossModel, check_head, chunked_ce_sum


class _Head:
    def __init__(self, lin):
        self.proj, self.softcap, self.scale = lin, None, None

    __call__ = LogitHead.__call__


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
def test_chunked_ce_equals_full_ce_and_grads(chunk):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 50, bias=False).double()
    h = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (2, 37))
    y[0, :5] = -100
    ref = F.cross_entropy(lin(h).reshape(-1, 50).float(), y.reshape(-1), reduction="sum")
    gh_ref, gw_ref = torch.autograd.grad(ref, (h, lin.weight))
    out = chunked_ce_sum(_Head(lin), h, y, chunk)
    gh, gw = torch.autograd.grad(out, (h, lin.weight))
    assert out.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-7)


def test_no_loss_tokens_gives_zero_and_connected_graph():
    lin = torch.nn.Linear(8, 10, bias=False)
    h = torch.randn(1, 4, 8, requires_grad=True)
    out = chunked_ce_sum(_Head(lin), h, torch.full((1, 4), -100), 2)
    out.backward()
    assert out.item() == 0.0 and h.grad is not None


def _local(model_len: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, model_len), generator=g)
    labels = ids.clone()
    labels[1, 40:] = -100  # a masked tail (e.g. padding) in one row
    cp = longdoc.ContextParallel()
    return cp, cp.shard_batch({"input_ids": ids, "labels": labels})


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma", "mixtral"])
def test_loss_model_matches_model_loss_and_never_holds_full_logits(arch):
    model = tiny_model(arch, vocab_size=300)
    cp, local = _local(64, 300)
    longdoc.patch(model, cp)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref = model(**local).loss  # transformers' own loss through the CP loss share (full logits)
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters()], allow_unused=True)

    stats = ChunkStats()
    hook = model.get_output_embeddings().register_forward_hook(stats)
    share, ce_sum = LossModel(model, chunk_tokens=16)(local["input_ids"], local["position_ids"],
                                                      local["shift_labels"], local["num_items_in_batch"])
    grads = torch.autograd.grad(share, [p for p in model.parameters()], allow_unused=True)
    hook.remove()
    assert share.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    n_loss = int((local["shift_labels"] != -100).sum())
    assert n_loss > 64  # the test really spans several chunks
    # the head saw at most 16 rows at a time, forward and the recomputation in backward alike
    assert stats.max_rows == 16
    assert stats.calls >= 2 * (n_loss // 16)


def test_check_head_refuses_an_unknown_logit_transform():
    model = tiny_model("llama", vocab_size=300)
    cp, local = _local(32, 300)
    longdoc.patch(model, cp)
    check_head(LossModel(model), local["input_ids"], local["position_ids"])  # plain lm_head: accepted
    model.config.final_logit_softcapping = 0.5  # the chunked head would cap, the model's forward does not
    with pytest.raises(ValueError, match="not lm_head"):
        check_head(LossModel(model), local["input_ids"], local["position_ids"], "tiny")
