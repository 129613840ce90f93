"""longdoc.hf.chunked_loss: a patched model's labelled forward computes its loss share from hidden states, a chunk of
loss tokens at a time, so no (local tokens x vocabulary) logits exist; equal to the model's own loss and gradients,
refused by name where the model's logits are not lm_head(decoder(x)); CPTrainer uses it by default."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.hf import UnsupportedFeatureError, chunked_loss, head, patch
from longdoc.train.loss import ChunkStats


def _patched(dtype=torch.float64, vocab_size: int | None = None):
    from longdoc.models import tiny_model

    model = tiny_model("llama", **({"vocab_size": vocab_size} if vocab_size else {})).to(dtype)
    cp = longdoc.ContextParallel()
    return patch(model, cp), cp


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def test_the_chunk_is_sized_from_the_vocabulary():
    assert head.loss_chunk_tokens(49_152) == 448  # SmolLM2: 12 * 448 * 49,152 bytes = 0.25 GiB
    assert head.loss_chunk_tokens(128_256) == 128
    assert head.loss_chunk_tokens(10**7) == 64  # never below one multiple
    for vocab in (256, 32_000, 49_152, 128_256, 262_144):
        chunk = head.loss_chunk_tokens(vocab)
        assert chunk % 64 == 0 and (12 * chunk * vocab <= head.LOSS_CHUNK_BYTES or chunk == 64)


def test_chunked_loss_equals_the_models_own_loss_and_gradients_and_never_builds_full_logits():
    model, cp = _patched()
    ids = torch.randint(0, model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :10] = -100  # prompt tokens carry no loss
    local = cp.shard_batch({"input_ids": ids, "labels": labels})
    want = model(**local)
    want.loss.backward()
    want_grads = _grads(model)
    rows = ChunkStats()
    hook = model.get_output_embeddings().register_forward_hook(rows)
    with chunked_loss(model, 16):
        got = model(**local)
    got.loss.backward()
    hook.remove()
    # the cross-entropy is fp32 in both (as transformers' own), summed in another order: fp32 rounding apart
    assert abs(got.loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item())
    for name, g in _grads(model).items():
        assert (g - want_grads[name]).abs().max() <= 1e-6 * want_grads[name].abs().max().clamp_min(1e-30), name
    # the probe rows, then chunks of at most 16 loss tokens (forward and backward recompute), never 2 x 50 rows
    assert got.logits.shape[1] == 4 and rows.max_rows == 16
    assert rows.calls > 2


def test_the_chunk_statistics_are_the_full_logits_statistics():
    model, cp = _patched()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        top = model(**cp.shard_batch({"input_ids": ids})).logits[0].argmax(-1)
    labels = ids.clone()
    labels[0, 1::2] = top[:-1:2]  # every other target is the model's own prediction: accuracy 0.5, not 0
    local = cp.shard_batch({"input_ids": ids, "labels": labels})
    with torch.no_grad():
        logits = model(**local).logits[0]
        stats: dict = {}
        with chunked_loss(model, 8, stats):
            model(**local)
    target = local["shift_labels"][0]
    keep = target != -100
    logp = torch.log_softmax(logits[keep].double(), dim=-1)
    correct = (logits[keep].argmax(-1) == target[keep]).sum()
    want = torch.stack([keep.sum().double(), -(logp.exp() * logp).sum(), correct])
    got = torch.stack(list(stats.values())).sum(0)
    assert want[2] >= 19 and torch.allclose(got, want.double(), rtol=1e-6)


def test_a_model_whose_logits_are_not_the_head_of_its_hidden_states_is_refused(monkeypatch):
    model, cp = _patched()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    local = cp.shard_batch({"input_ids": ids, "labels": ids})
    monkeypatch.setattr(head.LogitHead, "__call__", lambda self, h: self.proj(h) * 2.0)  # an unknown transform
    with pytest.raises(UnsupportedFeatureError, match="a chunked loss"), chunked_loss(model):
        model(**local)


def test_a_forward_that_keeps_its_own_logits_is_not_chunked():
    model, cp = _patched()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    local = cp.shard_batch({"input_ids": ids, "labels": ids})
    with chunked_loss(model, 4):
        out = model(**local, logits_to_keep=0)
    assert out.logits.shape[1] == 16


def test_cptrainer_trains_with_the_chunked_loss_by_default(tmp_path):
    from transformers import TrainingArguments

    from longdoc.hf.trainer import CPTrainer
    from tests.support.trainer_cases import collate, rows

    model, _ = _patched(torch.float32, vocab_size=256)
    from longdoc.hf import unpatch

    unpatch(model)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1,
                             per_device_train_batch_size=2, save_strategy="no")
    chunks = ChunkStats()
    trainer = CPTrainer(model=model, args=args, train_dataset=rows([24, 24], 0), data_collator=collate,
                        cp_loss_chunk_tokens=8)
    hook = model.get_output_embeddings().register_forward_hook(chunks)
    trainer.train()
    hook.remove()
    assert 0 < chunks.max_rows <= 8
    with pytest.raises(ValueError, match="cp_loss_chunk_tokens must be"):
        CPTrainer(model=model, args=args, train_dataset=rows([8], 0), data_collator=collate, cp_loss_chunk_tokens=-1)


def test_training_sizes_the_loss_chunk_from_the_vocabulary_by_default():
    from longdoc.train.config import TrainConfig
    from longdoc.train.loss import LossModel

    model, _ = _patched(torch.float32, vocab_size=49_152)  # SmolLM2's vocabulary
    assert TrainConfig().loss_chunk_tokens is None
    assert LossModel(model).chunk_tokens == head.loss_chunk_tokens(model.config.vocab_size) == 448
    assert LossModel(model, 96).chunk_tokens == 96


def test_evaluation_token_losses_come_from_chunks_of_the_head():
    from longdoc.hf.prefill import label_losses

    model, cp = _patched()
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(**cp.shard_batch({"input_ids": ids})).logits[0]
    want = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[0, 1:], reduction="none")
    rows = ChunkStats()
    hook = model.get_output_embeddings().register_forward_hook(rows)
    got, local = label_losses(model, cp, {"input_ids": ids, "labels": ids}, chunk_tokens=8)
    hook.remove()
    assert rows.max_rows == 8 and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
