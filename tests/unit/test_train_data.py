"""The step schedule is a pure function of (seed, step) and independent of the dp layout."""

from __future__ import annotations

import json

import pytest

from longdoc.train.config import DataConfig, RecipeError
from longdoc.train.data import Sequences, StepSchedule, collate, load_sequences, loss_tokens


def test_same_sequences_per_step_for_any_dp_layout():
    one = StepSchedule(10, batch_size=4, micro_batch_size=1, dp_size=1, seed=3)
    two = StepSchedule(10, batch_size=4, micro_batch_size=1, dp_size=2, seed=3)
    four = StepSchedule(10, batch_size=4, micro_batch_size=2, dp_size=2, seed=3)
    for step in range(7):
        want = sorted(one.step_indices(step))
        assert sorted(i for m in one.micro_batches(step, 0) for i in m) == want
        assert sorted(i for d in range(2) for m in two.micro_batches(step, d) for i in m) == want
        assert sorted(i for d in range(2) for m in four.micro_batches(step, d) for i in m) == want
    assert (one.accum, two.accum, four.accum) == (4, 2, 1)


def test_each_epoch_visits_every_sequence_once_in_a_new_order():
    s = StepSchedule(6, batch_size=2, micro_batch_size=1, dp_size=1, seed=0)
    epoch0 = [i for step in range(3) for i in s.step_indices(step)]
    epoch1 = [i for step in range(3, 6) for i in s.step_indices(step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(6))
    assert epoch0 != epoch1
    # a fresh schedule (a resumed run) gives the same order
    assert StepSchedule(6, 2, 1, 1, seed=0).step_indices(4) == s.step_indices(4)


def test_collate_pads_right_and_counts_loss_tokens():
    import datasets

    seqs = Sequences(datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8, 9]], "labels": [[5, -100, 7], [8, 9]]}),
                     "t")
    b = collate(seqs, [0, 1], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert b["labels"].tolist() == [[5, -100, 7], [8, 9, -100]]
    assert loss_tokens(seqs, [0, 1]) == 1 + 1  # after the shift: (-100, 7) and (9,)


def test_pretokenized_jsonl_and_errors(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps({"input_ids": list(range(i, i + 10))}) for i in range(3)) + "\n")
    seqs = load_sequences(DataConfig(path=str(f), seq_len=16), None, vocab_size=100, seed=0)
    assert len(seqs) == 3 and seqs.row(1)[0].tolist() == list(range(1, 11))
    assert seqs.row(1)[1].tolist() == list(range(1, 11))  # no labels column: every token is a target
    assert seqs.fingerprint()["tokens"] == 30
    with pytest.raises(RecipeError, match=r"token ids span \[0, 11\].*vocabulary has 8"):
        load_sequences(DataConfig(path=str(f), seq_len=16), None, vocab_size=8, seed=0)
    with pytest.raises(RecipeError, match=r"data.seq_len=4: 3 rows .* are longer"):
        load_sequences(DataConfig(path=str(f), seq_len=4), None, vocab_size=100, seed=0)
    masked = tmp_path / "masked.jsonl"
    masked.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}) + "\n")
    with pytest.raises(RecipeError, match="no training sequence with at least one loss token"):
        load_sequences(DataConfig(path=str(masked)), None, 100, 0)
    with pytest.raises(RecipeError, match="longdoc data synth"):
        load_sequences(DataConfig(path=str(tmp_path / "missing.jsonl")), None, 100, 0)


def test_raw_documents_go_through_corpus_prepare(tmp_path):
    from longdoc.corpus.synth import synthesize, write_jsonl
    from longdoc.models import load_tokenizer

    tok = load_tokenizer()
    docs = tmp_path / "legal.jsonl"
    write_jsonl(synthesize("legal", 1, 1024, seed=0), docs)
    qa = load_sequences(DataConfig(path=str(docs), task="qa", seq_len=1536, questions_per_row=1), tok, len(tok), seed=0)
    ids, labels = qa.row(0)
    scored = int((labels != -100).sum())
    assert len(qa) >= 2 and 0 < scored < 40 and ids.numel() > 1000  # the answer only, after the document
    pre = load_sequences(DataConfig(path=str(docs), task="pretrain", seq_len=512), tok, len(tok), seed=0)
    assert len(pre) >= 2 and all(pre.row(i)[0].numel() <= 512 for i in range(len(pre)))
