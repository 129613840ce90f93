"""The recipe `eval` section, early stopping and the optional trackers."""

from __future__ import annotations

import importlib.util

import pytest

from longdoc.train import recipe_from_dict
from longdoc.train.config import LogConfig, RecipeError
from longdoc.train.validation import EarlyStopping, due, extra_trackers


def _recipe(*overrides: str):
    return recipe_from_dict({"data": {"path": "random"}}, list(overrides))


def test_eval_section_checks():
    r = _recipe("eval.every=5", "eval.holdout=4", "eval.patience=2")
    assert (r.eval.every, r.eval.holdout, r.eval.patience) == (5, 4, 2)
    assert _recipe().eval.every == 0  # validation is off unless asked for
    with pytest.raises(RecipeError, match="eval.every: needs held-out rows: set eval.path"):
        _recipe("eval.every=5")
    with pytest.raises(RecipeError, match="eval.holdout: cannot be combined with eval.path"):
        _recipe("eval.every=5", "eval.holdout=2", "eval.path=held.jsonl")
    with pytest.raises(RecipeError, match="eval.patience: early stopping needs eval.every > 0"):
        _recipe("eval.holdout=2", "eval.patience=2")
    with pytest.raises(RecipeError, match=r"unknown recipe key eval.evry \(did you mean eval.every\?\)"):
        _recipe("eval.evry=2")


def test_due():
    ev = _recipe("eval.every=3", "eval.holdout=1").eval
    assert [s for s in range(1, 8) if due(ev, s, s == 7)] == [3, 6, 7]


def test_early_stopping_plateau_and_state():
    stop = EarlyStopping(patience=2, min_delta=0.1)
    assert [stop.update(v, s) for s, v in enumerate([3.0, 2.5, 2.45, 2.6, 2.0, 1.95, 1.99], 1)] == \
        [False, False, False, True, False, False, True]
    assert (stop.best, stop.best_step) == (2.0, 5)
    again = EarlyStopping(patience=2, min_delta=0.1)
    again.load_state_dict(stop.state_dict())
    assert again.state_dict() == stop.state_dict()
    assert not any(EarlyStopping(patience=0).update(v, s) for s, v in enumerate([1.0, 2.0, 3.0]))


def test_trackers(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="log.trackers: unknown tracker"):
        LogConfig(trackers=["neptune"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow", "trackio")
                        else real(name, *a))
    assert extra_trackers(LogConfig(trackers=["auto"]), tmp_path) == ([], {})  # auto: whatever is installed
    with pytest.raises(RecipeError, match=r"\['wandb'\] not installed; `pip install wandb`"):
        extra_trackers(LogConfig(trackers=["wandb"]), tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else None)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    names, kwargs = extra_trackers(LogConfig(trackers=["auto"]), tmp_path)
    assert names == ["wandb"] and kwargs["wandb"]["dir"] == str(tmp_path.resolve())
    import os

    assert os.environ["WANDB_MODE"] == "offline"  # no network: runs are synced later with `wandb sync`


def _rows(docs_epochs: list[tuple[str, int]]):
    from datasets import Dataset

    from longdoc.train.data import Sequences

    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "doc_ids": [d], "epoch": e} for d, e in docs_epochs]
    return Sequences(Dataset.from_list(rows), "test rows")


def test_holdout_keeps_every_pass_and_window_of_a_held_out_document_out_of_training():
    from longdoc.train.data import document_keys
    from longdoc.train.validation import split_held_out

    # three documents, two passes each (QA rows prepared for a longer run), passes written per document
    seqs = _rows([("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)])
    recipe = recipe_from_dict({"data": {"path": "random"}, "eval": {"holdout": 1, "every": 1}})
    train, held = split_held_out(recipe, seqs, None, 256)
    held_docs = set().union(*document_keys(held))
    train_docs = set().union(*document_keys(train))
    assert held_docs == {"c"} and len(held) == 1  # one pass of the last document
    assert not held_docs & train_docs and len(train) == 4
    with pytest.raises(RecipeError, match="eval.holdout=3 would leave no training rows"):
        split_held_out(recipe_from_dict({"data": {"path": "random"}, "eval": {"holdout": 3, "every": 1}}),
                       seqs, None, 256)


def test_max_sequences_caps_documents_not_the_first_rows_of_the_passes(tmp_path):
    """A quick run with data.max_sequences=N trains on the first N rows' documents in every pass, not on the
    first N rows of the multi-pass data (a few documents repeated)."""
    from longdoc.corpus.synth import synthesize, write_jsonl
    from longdoc.models import load_tokenizer
    from longdoc.train.config import DataConfig
    from longdoc.train.data import document_keys, load_sequences, passes

    docs = tmp_path / "docs.jsonl"
    write_jsonl(synthesize("legal", 4, 1024, seed=3), docs)
    tok = load_tokenizer("SmolLM2-135M-Instruct")
    cfg = DataConfig(path=str(docs), task="qa", seq_len=1536, max_sequences=2)
    seqs = load_sequences(cfg, tok, len(tok), seed=0, rows_needed=8)
    keys, epochs = document_keys(seqs), passes(seqs)
    assert max(epochs) >= 1  # several passes were prepared
    assert len(set().union(*keys)) <= 2  # ... of at most the first 2 rows' documents
    assert sum(e == 0 for e in epochs) == 2
