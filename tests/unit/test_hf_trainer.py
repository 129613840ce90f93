"""CPTrainer refusals: every one is raised before any communication, naming the problem and the fix."""

from __future__ import annotations

import pytest
import torch

from longdoc.hf.trainer import CPTrainer, CPTrainerMixin, check_cp_size
from tests.support.trainer_cases import collate, rows, sft_rows, word_tokenizer


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


def _model():
    from longdoc.models import tiny_model

    return tiny_model("llama", vocab_size=256)


def test_check_cp_size():
    assert check_cp_size(2, 4) == 2 and check_cp_size(1, 1) == 1
    with pytest.raises(ValueError, match="needs at least 2 processes.*torchrun --nproc_per_node 2"):
        check_cp_size(2, 1)
    with pytest.raises(ValueError, match=r"must divide the number of processes \(6\); use one of \[1, 2, 3, 6\]"):
        check_cp_size(4, 6)
    with pytest.raises(ValueError, match="positive integer"):
        check_cp_size(0, 2)


def test_cp_size_larger_than_the_world_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cp_size=2 needs at least 2 processes"):
        CPTrainer(model=_model(), args=_args(tmp_path), train_dataset=rows([8], 0), data_collator=collate, cp_size=2)


@pytest.mark.parametrize("flag", ["packing", "padding_free"])
def test_trl_packing_is_accepted(tmp_path, flag):
    """Packed / padding-free rows are exact under CP (shard_batch masks the documents): no refusal."""
    from trl import SFTConfig, SFTTrainer

    class CPSFTTrainer(CPTrainerMixin, SFTTrainer):
        pass

    from datasets import Dataset

    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                     max_length=64 if flag == "packing" else None, **{flag: True})
    trainer = CPSFTTrainer(model=_model(), args=args, processing_class=word_tokenizer(),
                           train_dataset=Dataset.from_list(sft_rows([8, 5], 0)))
    assert trainer.cp.size == 1
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    assert "position_ids" in trainer._full_batch(batch)


def test_label_smoothing_and_custom_loss_are_refused(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor is not supported under CP"):
        CPTrainer(model=_model(), args=_args(tmp_path, label_smoothing_factor=0.1), train_dataset=rows([8], 0))
    with pytest.raises(ValueError, match="compute_loss_func is not supported under CP"):
        CPTrainer(model=_model(), args=_args(tmp_path), train_dataset=rows([8], 0),
                  compute_loss_func=lambda *a, **k: 0)


def test_batches_cp_cannot_run_exactly_are_refused(tmp_path):
    trainer = CPTrainer(model=_model(), args=_args(tmp_path), train_dataset=rows([8, 5], 0), data_collator=collate)
    batch = collate(rows([8, 5], 0))
    assert set(trainer._full_batch(batch)) == {"input_ids", "labels", "attention_mask"}
    packed = dict(batch, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2))
    assert "position_ids" in trainer._full_batch(packed)  # packed rows go on to shard_batch's document masking
    with pytest.raises(ValueError, match=r"the batch holds \['token_type_ids'\]"):
        trainer._full_batch(dict(batch, token_type_ids=torch.zeros_like(batch["input_ids"])))
    with pytest.raises(ValueError, match="the batch has no labels"):
        trainer._full_batch({"input_ids": batch["input_ids"]})
    # the loss-token count is the one shard_batch uses: shifted, padding never counts
    n = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert int(n) == int((batch["labels"][:, 1:] != -100).sum())


def test_dpo_needs_its_own_mixin_and_a_checked_trl():
    from transformers import Trainer
    from trl import DPOTrainer

    from longdoc.hf.dpo_trainer import CPDPOTrainerMixin, check_trl_version

    with pytest.raises(TypeError, match=r"for trl.DPOTrainer use longdoc.hf.CPDPOTrainerMixin"):
        type("T", (CPTrainerMixin, DPOTrainer), {})(model=None)
    with pytest.raises(TypeError, match=r"goes in front of trl.DPOTrainer"):
        type("T", (CPDPOTrainerMixin, Trainer), {})(model=None)
    check_trl_version()  # the installed TRL is the one this was written for
    with pytest.raises(RuntimeError, match=r"written for TRL 1.16.0.*got trl 9.0.0.*TESTED_TRL"):
        check_trl_version("9.0.0")
