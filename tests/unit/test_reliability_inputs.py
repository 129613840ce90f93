"""Bad input is refused with a message that names the problem and the fix; unsafe loading is never done.

The README's Reliability table lists every case. Cases already asserted elsewhere (not repeated here):
unknown recipe key -> tests/unit/test_train_config.py::test_bad_recipes_fail_with_the_key_and_the_fix;
token ids outside the vocabulary / empty dataset after filtering ->
tests/unit/test_train_data.py::test_pretokenized_jsonl_and_errors; unsupported attention features ->
tests/unit/test_hf_patch.py::test_refuses_*; output folder not writable ->
tests/dist/test_train_faults.py::test_unwritable_output_dir; resume with another model name, seed or
batch size -> tests/dist/test_train_faults.py::test_resume_guards; .bin-only model folder ->
tests/unit/test_models.py::test_pickle_only_folder_is_refused.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import longdoc.hf
from longdoc import models
from longdoc.train.config import RecipeError, recipe_from_dict
from longdoc.train.world import check_launch
from tests.support.fake_cp import FakeCP, loss_share

ROOT = Path(__file__).resolve().parents[2]


def test_cp_size_must_divide_the_world_size():
    recipe = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.cp_size=3"])
    with pytest.raises(RecipeError, match=re.escape("parallelism.cp_size=3 must divide the number of processes (4); "
                                                    "use a cp_size among [1, 2, 4]")):
        check_launch(recipe, 4, cuda=False)
    with pytest.raises(RecipeError, match="parallelism.cp_size=3 needs at least 3 processes, but this run has 1"):
        check_launch(recipe, 1, cuda=False)


def test_sequence_shorter_than_the_cp_size_is_padded_and_exact():
    # 3 tokens over 4 ranks (zigzag needs a multiple of 8): ranks hold padding only, the loss stays exact
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (1, 3))
    logits = torch.randn(1, 3, 50)
    want = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    total = 0.0
    for rank in range(4):
        cp = FakeCP(rank, 4)
        local = longdoc.hf.shard_batch({"input_ids": ids, "labels": ids.clone()}, cp)
        total = total + loss_share(logits, local, cp)
        assert local["input_ids"].shape == (1, 2)
    torch.testing.assert_close(total, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"needs a multiple of 2\); pad it to 4, or use cp.shard_batch"):
        longdoc.ContextParallel().shard(torch.zeros(1, 3), dim=1)


@pytest.fixture(scope="module")
def patched_tiny():
    model, tok = models.load("tiny:llama", vocab_size=256)
    return longdoc.patch(model, longdoc.ContextParallel()), tok


@pytest.mark.parametrize("bad", [256, 10_000, -1])
def test_token_ids_outside_the_embedding_are_refused_not_indexed(patched_tiny, bad):
    model, _ = patched_tiny
    cp = longdoc.ContextParallel()
    batch = cp.shard_batch({"input_ids": torch.tensor([[1, 2, bad, 4]])})
    with pytest.raises(longdoc.hf.CPInputError, match=rf"token ids spanning \[.*{bad}.*\] \(its embedding has 256 "
                                                      r"rows.*tokenize with this model's tokenizer"):
        model(**batch)
    ok = cp.shard_batch({"input_ids": torch.tensor([[1, 2, 255, 0]])})
    assert torch.isfinite(model(**ok).logits).all()  # the boundary ids are fine


def test_tokenizer_larger_than_the_model_embedding(tmp_path, patched_tiny):
    from longdoc.train.config import DataConfig
    from longdoc.train.data import load_sequences

    _, tok = patched_tiny  # the default 49k-token tokenizer, a 256-row embedding
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"input_ids": tok("a contract between the parties")["input_ids"]}) + "\n")
    with pytest.raises(RecipeError, match=rf"vocabulary has 256 entries.*tokenizer has {len(tok)} tokens but the "
                                          r"model's embedding only 256: tokenizer and model do not match"):
        load_sequences(DataConfig(path=str(f), seq_len=64), tok, vocab_size=256, seed=0)


def test_trust_remote_code_is_off_unless_the_recipe_turns_it_on(monkeypatch):
    from longdoc.train import modeling

    seen, real = [], (models.load, models.load_tokenizer, models.load_config)

    def fake_load(name, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise StopIteration  # stop before anything is built

    monkeypatch.setattr(models, "load", fake_load)
    for overrides in ([], ["model.trust_remote_code=true"]):
        r = recipe_from_dict({"data": {"path": "random"}, "model": {"name": "some/folder"}}, overrides)
        with pytest.raises(StopIteration):
            modeling.build(r.model, r.lora, r.train, r.parallelism, longdoc.ContextParallel(), 64)
    assert seen == [False, True]
    for fn in real:
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False


def test_no_pickle_loading_in_the_package():
    # weights come from safetensors or GGUF only; a torch.load would need weights_only=True
    offenders = []
    for path in sorted((ROOT / "longdoc").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b(pickle|dill|cloudpickle)\.loads?\(|import (c?pickle|dill)\b", code):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
            if "torch.load(" in code and "weights_only=True" not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
            if "use_safetensors=False" in code:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "pickle-based loading:\n" + "\n".join(offenders)
