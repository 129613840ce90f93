"""The layer-kind mechanism (longdoc.hf.kinds) in one process: swapping, counting, undo, refusals by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import longdoc
from longdoc import models
from longdoc.hf import UnsupportedFeatureError, is_patched, kinds, patch, unpatch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)


def _ids(length=16, seed=0):
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _fake_kind(calls: list, problem=None, packed=True, skip=False):
    """A kind over LlamaMLP that records its calls and runs the module's own forward (an exact "CP route")."""

    def forward(module, handle, original, x):
        calls.append(type(module).__name__)
        return original(x)

    return kinds.LayerKind(name="fake_mlp", matches=lambda m: type(m).__name__ == "LlamaMLP", forward=forward,
                           problem=(lambda m, h: problem) if problem else kinds._no_problem,
                           replaces_attention=False, packed=packed)


@pytest.fixture
def cp():
    return longdoc.ContextParallel()


def test_swapped_modules_run_through_their_kind_and_unpatch_restores(cp, monkeypatch):
    calls: list = []
    monkeypatch.setattr(kinds, "KINDS", (_fake_kind(calls),))
    ids = _ids()
    ref = models.tiny_model("llama")(input_ids=ids, labels=ids)
    model = patch(models.tiny_model("llama"), cp)
    assert sum(kinds.is_swapped(m) for m in model.modules()) == 2
    out = model(**cp.shard_batch({"input_ids": ids, "labels": ids}))
    assert calls == ["LlamaMLP", "LlamaMLP"]
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6
    twin = copy.deepcopy(model)  # the copy's swapped forwards run the copy's own modules
    twin_mlp = twin.model.layers[0].mlp
    assert twin_mlp.forward.module_ref is twin_mlp
    unpatch(model)
    assert not is_patched(model) and not any(kinds.is_swapped(m) for m in model.modules())
    calls.clear()
    model(input_ids=ids)
    assert calls == []


def test_a_module_that_bypasses_its_kind_fails_the_forward(cp, monkeypatch):
    calls: list = []
    monkeypatch.setattr(kinds, "KINDS", (_fake_kind(calls),))
    model = patch(models.tiny_model("llama"), cp)
    layer = model.model.layers[1].mlp
    bypass = layer.forward.original
    layer.__dict__["forward"] = bypass  # as if the model called the module's code some other way
    with pytest.raises(RuntimeError, match="only 1 of 2 fake_mlp layers"):
        model(**cp.shard_batch({"input_ids": _ids(), "labels": _ids()}))


def test_a_kind_refuses_a_module_by_name(cp, monkeypatch):
    monkeypatch.setattr(kinds, "KINDS", (_fake_kind([], problem=("a fused CUDA kernel", "install nothing")),))
    with pytest.raises(UnsupportedFeatureError, match=r"a fused CUDA kernel \(in model.layers.0.mlp\)"):
        patch(models.tiny_model("llama"), cp)


def test_packed_rows_through_a_kind_without_packing_are_refused(cp, monkeypatch):
    monkeypatch.setattr(kinds, "KINDS", (_fake_kind([], packed=False),))
    model = patch(models.tiny_model("llama"), cp)
    ids = _ids(16)
    pos = torch.cat([torch.arange(8), torch.arange(8)])[None]
    with pytest.raises(UnsupportedFeatureError, match="packed rows .* fake_mlp layers"):
        model(**cp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos}))


@pytest.mark.parametrize("arch", ["mamba2", "rwkv", "xlstm"])
def test_mixers_without_a_kind_are_refused_by_name(arch, cp, monkeypatch):
    monkeypatch.setattr(kinds, "KINDS", ())
    config = AutoConfig.for_model(arch)
    for key, value in TINY.items():
        if hasattr(config, key):
            setattr(config, key, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert kinds.unknown_mixers(model)
    with pytest.raises(UnsupportedFeatureError, match="linear attention|sequence-mixing layers"):
        patch(model, cp)


@pytest.mark.parametrize("arch", models.TINY_ARCHS)
def test_attention_models_have_no_mixers(arch):
    assert kinds.unknown_mixers(models.tiny_model(arch)) == []


def test_each_table_holds_one_shape_and_a_name_is_registered_once():
    shapes = {id(kinds.ROUTED): kinds.Routed, id(kinds.FORWARDS): kinds.Forward,
              id(kinds.ATTENTION_TWEAKS): kinds.AttentionTweak, id(kinds.REFUSED): kinds.Refused}
    for table in (kinds.ROUTED, kinds.FORWARDS, kinds.ATTENTION_TWEAKS, kinds.REFUSED):
        assert table and all(type(e) is shapes[id(table)] for e in table.values())
    assert [k.name for k in kinds.KINDS] == [n for t in (kinds.ROUTED, kinds.FORWARDS, kinds.ATTENTION_TWEAKS,
                                                         kinds.REFUSED) for n in t]
    with pytest.raises(ValueError, match="'mamba2' is registered already"):
        kinds.register(kinds.Refused(name="mamba2", matches=lambda m: False, problem=lambda m, h: None))
    assert type(kinds.ROUTED["mamba2"]) is kinds.Routed
