"""The upstream-source check (longdoc.hf.upstream): every kind says whether it re-implements transformers code, the
installed transformers' sources are the recorded ones, and a changed or missing source is refused by name."""

from __future__ import annotations

import importlib
import sys

import pytest
import transformers

import longdoc
from longdoc.hf import UnsupportedFeatureError, kinds, patch, unpatch, upstream
from tests.support.hf_hybrids_linear import linear_config, linear_model


@pytest.fixture(autouse=True)
def _fresh_digests():
    upstream.resolve.cache_clear()  # a test may change what the sources read as
    yield
    upstream.resolve.cache_clear()


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _bare(cls: type):
    """An instance that only its class and the attributes a kind's `matches` reads describe (no __init__)."""
    module = cls.__new__(cls)
    module.__dict__.update(attn_temperature_tuning=True, use_rope=False)  # Llama 4's tuned NoPE layers
    return module


def _kind(name: str):
    return next(k for k in kinds.KINDS if k.name == name)


def test_every_kind_says_whether_it_reimplements_transformers_code():
    names = [k.name for k in kinds.KINDS]
    assert not set(upstream.REIMPLEMENTED) & set(upstream.OWN_CODE)
    unclassified = set(names) - set(upstream.REIMPLEMENTED) - set(upstream.OWN_CODE)
    assert not unclassified, f"add these kinds to longdoc.hf.upstream.REIMPLEMENTED or OWN_CODE: {unclassified}"
    assert not (set(upstream.REIMPLEMENTED) | set(upstream.OWN_CODE)) - set(names)  # no stale entries
    # the kinds that compute a module's forward themselves, or assume what its methods do, are all covered
    assert set(upstream.REIMPLEMENTED) == {"zaya_cca", "lightning", "xlstm", "rglru", "rwkv", "llama4_temperature"}


@pytest.mark.parametrize("kind", sorted(upstream.REIMPLEMENTED))
def test_the_installed_transformers_sources_are_the_recorded_ones(kind):
    spec = upstream.REIMPLEMENTED[kind]
    for path in spec.classes:
        module = _bare(_class(path))
        assert _kind(kind).matches(module), f"{kind} does not match {path}"
        assert upstream.problem(kind, module) is None
        for name in spec.names:
            qualified, found = upstream.resolve(type(module), name)
            assert transformers.__version__ in upstream.DIGESTS[qualified][found]


def test_methods_resolve_through_the_mro_to_the_class_that_defines_them():
    base = _class("transformers.models.zaya.modeling_zaya.ZayaCCAProjection")
    inherits = type("ZayaCCAProjection", (base,), {"__module__": base.__module__})
    assert upstream.resolve(inherits, "forward") == upstream.resolve(base, "forward")
    qualified, _ = upstream.resolve(inherits, "forward")
    assert qualified == "transformers.models.zaya.modeling_zaya.ZayaCCAProjection.forward"
    assert upstream.problem("zaya_cca", _bare(inherits)) is None

    def forward(self, hidden_states, cache=None, conv_mask=None):
        return base.forward(self, hidden_states, cache, conv_mask)

    overrides = type("ZayaCCAProjection", (base,), {"__module__": __name__, "forward": forward})
    feature, fix = upstream.problem("zaya_cca", _bare(overrides))
    assert f"{__name__}.ZayaCCAProjection.forward" in feature


def test_a_changed_source_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(upstream, "digest", lambda source: "0" * 16)
    module = _bare(_class("transformers.models.zaya.modeling_zaya.ZayaCCAProjection"))
    feature, fix = upstream.problem("zaya_cca", module)
    assert "ZayaCCAProjection" in feature and "transformers.models.zaya.modeling_zaya.ZayaCCAProjection.forward" \
        in feature
    assert "'zaya_cca'" in feature and "5.24.0, 5.25.0" in feature and transformers.__version__ in feature
    assert "constraints.txt" in fix and "python -m longdoc.hf.upstream --update" in fix


def test_patch_refuses_a_model_whose_reimplemented_source_changed(monkeypatch):
    model = linear_model("rwkv", linear_config("rwkv"))
    patch(model, longdoc.ContextParallel())  # the installed transformers: accepted
    unpatch(model)
    real = upstream.digest
    monkeypatch.setattr(upstream, "digest", lambda source: "0" * 16 if "def rwkv_linear_attention_cpu" in source
                        else real(source))
    upstream.resolve.cache_clear()  # the first patch read the real sources
    with pytest.raises(UnsupportedFeatureError, match=r"RwkvSelfAttention: its transformers\.models\.rwkv\."
                                                      r"modeling_rwkv\.rwkv_linear_attention_cpu .* is not the "
                                                      r"source longdoc's 'rwkv' layer kind re-implements"):
        patch(model, longdoc.ContextParallel())


def test_a_missing_upstream_function_is_refused_by_name(monkeypatch):
    cls = _class("transformers.models.rwkv.modeling_rwkv.RwkvFeedForward")
    monkeypatch.delattr(sys.modules[cls.__module__], "rwkv_linear_attention_cpu")
    feature, _ = upstream.problem("rwkv", _bare(cls))
    assert "RwkvFeedForward: its :rwkv_linear_attention_cpu (transformers" in feature
    assert "cannot be read" in feature and "'rwkv' layer kind re-implements it" in feature


def test_update_records_the_installed_version(tmp_path):
    table = upstream.merged(upstream.current(), "9.9.9")
    namespace: dict = {}
    exec(upstream.render(table), namespace)  # what --update writes into upstream.py is the same table
    assert namespace["DIGESTS"] == table
    assert all("9.9.9" in next(v for d, v in known.items() if d == upstream.current()[q])
               for q, known in table.items() if q in upstream.current())
    assert upstream.render(upstream.DIGESTS) in open(upstream.__file__).read()  # the file is --update's output
