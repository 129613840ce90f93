"""Recurrent layer kinds in one process: which mixers they match, refusals by name (an entry point without a
route, a forward replaced by a fused kernel, decode-only updates on sharded tokens), and patch at cp=1 giving
the model's own outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import longdoc
from longdoc.hf import UnsupportedFeatureError, kinds, patch, recurrent
from longdoc.hf.kinds import mamba, mamba2, shortconv
from tests.support.hf_hybrids import HYBRIDS, hybrid_config, hybrid_pair


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_every_mixer_of_the_tiny_hybrids_has_a_kind_and_every_entry_point_a_route(arch):
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hybrid_config(arch))
    found = kinds.find(model)
    assert found and kinds.unknown_mixers(model) == []
    for _, module, kind in found:
        assert kind.problem(module, None) is None
        if kind.name != "zaya_cca":  # ZAYA's CCA is a mixer-level forward (kinds/zaya.py): no kernel entry points
            assert recurrent.hooks(module), type(module).__name__  # the mixer calls kernel entry points


def test_an_entry_point_without_a_route_is_refused_by_name(monkeypatch):
    entry = kinds.ROUTED["mamba2"]
    monkeypatch.setitem(kinds.ROUTED, "mamba2", dataclasses.replace(entry, routed=entry.routed - {"mamba2_chunk_scan"}))
    _, model = hybrid_pair("mamba2")
    with pytest.raises(UnsupportedFeatureError, match=r"Mamba2Mixer calling mamba2_chunk_scan \(a fused-kernel "):
        patch(model, longdoc.ContextParallel())


def test_a_forward_that_bypasses_the_routes_fails_the_call():
    _, model = hybrid_pair("lfm2")
    patch(model, longdoc.ContextParallel())
    conv = next(m for m in model.modules() if type(m).__name__ == "Lfm2ShortConv")
    conv.forward.original = lambda hidden_states, *a, **k: torch.zeros_like(hidden_states)  # as a fused kernel would
    ids = torch.randint(0, 256, (1, 16))
    with pytest.raises(RuntimeError, match="did not call causal_conv1d_fn: its forward is not transformers' own"):
        model(**longdoc.ContextParallel().shard_batch({"input_ids": ids, "labels": ids}))


def test_decode_only_updates_refuse_to_run_on_sharded_tokens():
    with pytest.raises(RuntimeError, match="causal_conv1d_update ran on CP-sharded tokens"):
        recurrent.never("causal_conv1d_update")(None, torch.zeros(1))


@pytest.mark.parametrize("arch", ["mamba2", "jamba", "lfm2"])
def test_patched_at_cp1_gives_the_models_own_loss_and_grads(arch):
    ref, model = hybrid_pair(arch)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    cp = longdoc.ContextParallel()
    out = patch(model, cp)(**cp.shard_batch({"input_ids": ids, "labels": ids}))
    out.loss.backward()
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6
    assert sum(model._longdoc_cp.kind_calls.values()) == len(kinds.find(model))
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max() <= 1e-5 * p.grad.abs().max().clamp_min(1e-6), n


def test_routes_are_restored_and_other_threads_see_the_originals():
    import threading

    import transformers.models.mamba2.modeling_mamba2 as m2

    _, model = hybrid_pair("mamba2")
    mixer = model.backbone.layers[0].mixer
    before = m2.causal_conv1d_fn
    seen = {}
    with recurrent.route(mixer, {"causal_conv1d_fn": lambda fn, *a, **k: "cp"}):
        assert m2.causal_conv1d_fn(torch.zeros(1, 2, 3), torch.zeros(2, 2)) == "cp"
        t = threading.Thread(target=lambda: seen.update(out=m2.causal_conv1d_fn(torch.zeros(1, 2, 3),
                                                                                torch.zeros(2, 2))))
        t.start()
        t.join()
    assert torch.is_tensor(seen["out"]) and m2.causal_conv1d_fn is before
    assert {mamba.KIND.name, shortconv.KIND.name, mamba2.KIND.name} <= {k.name for k in kinds.KINDS}


@pytest.mark.parametrize("arch", ["mamba2", "granitemoehybrid"])
def test_tiny_hybrids_are_in_the_tiny_registry(arch):
    from longdoc import models

    assert arch in models.TINY_HYBRIDS and arch not in models.TINY_ARCHS  # TINY_ARCHS: attention-only
    model, _ = models.load(f"tiny:{arch}")
    assert kinds.find(model) and kinds.unknown_mixers(model) == []
    cp = longdoc.ContextParallel()
    ids = torch.randint(0, 256, (1, 12))
    assert torch.isfinite(patch(model, cp)(**cp.shard_batch({"input_ids": ids, "labels": ids})).loss)


def _torch_fn(x, weight):
    return x + weight


def _entry_points():
    """The same torch function behind both wrappings of transformers' kernel entry points: functools.wraps alone
    (transformers <= 5.24 without the `kernels` package) and a kernels `Func` module around that (>= 5.25)."""
    import functools

    from kernels import use_kernel_forward_from_hub

    @functools.wraps(_torch_fn)
    def dispatch(*args, **kwargs):  # as use_kernel_func_from_hub_with_fallback's `wrapped`: may pick a fused kernel
        raise AssertionError("the dispatcher ran: a fused kernel would have run on CP-sharded tokens")

    return {"functools": dispatch, "kernels Func": use_kernel_forward_from_hub("longdoc_test_fn")(dispatch)}


@pytest.mark.parametrize("wrapping", ["functools", "kernels Func"])
def test_torch_path_reaches_the_torch_function_behind_either_wrapping(wrapping):
    entry = _entry_points()[wrapping]
    assert recurrent.is_entry_point(entry)
    assert recurrent.torch_path(entry) is _torch_fn
    assert recurrent.torch_path(_torch_fn) is _torch_fn and not recurrent.is_entry_point(_torch_fn)


def test_the_installed_transformers_entry_points_are_found_and_unwrapped():
    import transformers.models.mamba2.modeling_mamba2 as m2

    for name in ("causal_conv1d_fn", "mamba2_chunk_scan"):
        fn = recurrent.torch_path(getattr(m2, name))
        assert fn.__module__ == m2.__name__ and fn.__code__.co_filename == m2.__file__, name
        assert not recurrent.is_entry_point(fn), name


def test_a_func_module_whose_torch_function_cannot_be_found_fails_loudly():
    from kernels import use_kernel_forward_from_hub

    def bare(x):  # a hub-replaceable torch function: its Func calls it directly
        return x

    entry = use_kernel_forward_from_hub("longdoc_test_bare")(bare)
    assert recurrent.torch_path(entry) is bare
    type(entry).forward = lambda self, *args, **kwargs: None  # a kernels release that dispatches otherwise
    with pytest.raises(recurrent.EntryPointError, match="whose torch function longdoc cannot find"):
        recurrent.torch_path(entry)


def test_a_blind_entry_point_discovery_fails_loudly_instead_of_passing(monkeypatch):
    """If transformers wraps entry points in a way `is_entry_point` does not know, `unrouted` must not pass."""
    _, model = hybrid_pair("mamba2")
    mixer = next(m for m in model.modules() if type(m).__name__ == "Mamba2Mixer")
    monkeypatch.setattr(recurrent, "is_entry_point", lambda value: False)
    with pytest.raises(recurrent.EntryPointError,
                       match="cannot recognise .*mamba2_chunk_scan.* as kernel entry points"):
        recurrent.unrouted(mixer, mamba2.ROUTED)
