"""Offloaded layer checkpoints (longdoc.hf.offload) and the sequence-tiled MLP (longdoc.hf.tiled_mlp) in one
process: the offload really moves one input per checkpointed layer to host and prefetches the layer below; the tiled
MLP never creates a (tokens x intermediate) tensor, forward or backward; unknown MLP classes and dropout are refused
by name. Exactness under CP: tests/dist/test_train_offload_tiled.py. The CUDA path: the `gpu` test at the end."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from longdoc.hf.modelinfo import UnsupportedFeatureError
from longdoc.hf.offload import offload_checkpoints
from longdoc.hf.tiled_mlp import tile_mlps, untile_mlps
from tests.support.offload_tiled_cases import batch, rel_err, tiny


def _loss_grads(model, full):
    model.zero_grad(set_to_none=True)
    loss = model(**full).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_moves_each_checkpointed_input_to_host_and_back(reentrant):
    full = batch(seq_len=40)
    ref = tiny("llama")
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    want = _loss_grads(ref, full)
    model = tiny("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    off = offload_checkpoints(model)
    assert offload_checkpoints(model) is off  # installed once
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size

    loss = model(**full).loss
    # after the forward: one hidden state per layer, held by the hooks as a separate host copy
    entries = off.live_entries()
    assert off.stats.moved == len(entries) == layers
    assert off.host_bytes() == layers * 40 * hidden * 4
    assert all(e.host.device.type == "cpu" for e in entries)
    loss.backward()
    assert off.stats.restored == layers and off.stats.prefetch_hits == layers - 1  # the layer below, one ahead
    got = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert got[0].equal(want[0]) and got[1].keys() == want[1].keys()
    assert all(got[1][n].equal(want[1][n]) for n in want[1])  # bitwise: the recompute reads an exact copy
    del loss, entries
    assert off.host_bytes() == 0  # freed with the graph (torch's checkpoint keeps its inputs until then too)


def test_offload_refuses_a_model_without_checkpointing():
    model = tiny("llama")
    model.activation_checkpointing_disable()
    with pytest.raises(ValueError, match="activation_checkpointing_enable"):
        offload_checkpoints(model)


def test_recipe_keys():
    from longdoc.train.config import ParallelismConfig, RecipeError, recipe_from_dict

    assert not ParallelismConfig().offload_checkpoints and not ParallelismConfig().tiled_mlp
    with pytest.raises(RecipeError, match="parallelism.offload_checkpoints: .* train.activation_checkpointing=true"):
        recipe_from_dict({"data": {"path": "random"}, "train": {"activation_checkpointing": False},
                          "parallelism": {"offload_checkpoints": True}})
    with pytest.raises(RecipeError, match="parallelism.mlp_tile_tokens"):
        ParallelismConfig(tiled_mlp=True, mlp_tile_tokens=0)


class _Largest(TorchDispatchMode):
    """The largest tensor any op creates (parameter-shaped ones, i.e. weight gradients, left out)."""

    def __init__(self, skip_shapes):
        super().__init__()
        self.skip, self.largest = skip_shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip:
                self.largest = max(self.largest, t.numel())
        return out


TOKENS, TILE, HIDDEN, INTER = 512, 32, 16, 256


def _mlps():
    """(name, module, inputs) of the three MLP kinds, hidden 16, intermediate 256, 512 tokens."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, HIDDEN)
    llama = LlamaMLP(transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2,
                                                num_key_value_heads=2))
    gpt2 = GPT2MLP(INTER, transformers.GPT2Config(n_embd=HIDDEN, n_head=2, resid_pdrop=0.0))
    experts = MixtralExperts(transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                        num_local_experts=4, num_attention_heads=2,
                                                        num_key_value_heads=2))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    top_w, top_i = torch.rand(TOKENS, 4).softmax(-1).topk(2, dim=-1)
    return [("gated", llama, (x,)), ("plain", gpt2, (x,)), ("experts", experts, (x[0], top_i, top_w))]


class _Holder(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


@pytest.mark.parametrize("kind", ["gated", "plain", "experts"])
def test_tiled_mlp_never_holds_tokens_x_intermediate(kind):
    from longdoc.hf import tiled_mlp

    name, mlp, inputs = next(c for c in _mlps() if c[0] == kind)
    skip = {tuple(p.shape) for p in mlp.parameters()}
    results = {}
    for tiled in (False, True):
        if tiled:
            fwd = (tiled_mlp._ExpertsForward if kind == "experts" else tiled_mlp._DenseForward)(mlp, TILE)
        else:
            fwd = mlp.forward
        mlp.zero_grad(set_to_none=True)
        leaf = inputs[0].clone().requires_grad_()
        args = (leaf, *inputs[1:])
        if kind == "experts":
            args = (leaf, inputs[1], inputs[2].clone().requires_grad_())
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _Largest(skip) as fwd_mode:
                out = fwd(*args)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        with _Largest(skip) as bwd_mode:
            out.backward(g)
        grads = [leaf.grad] + [p.grad for p in mlp.parameters()] + ([args[2].grad] if kind == "experts" else [])
        results[tiled] = (out.detach(), grads, max(saved), fwd_mode.largest, bwd_mode.largest)
    full, tile = TOKENS * INTER, 2 * TILE * INTER  # a tile's fused gate/up is (tile, 2 x intermediate)
    _, _, saved_u, fwd_u, bwd_u = results[False]
    assert max(saved_u, fwd_u, bwd_u) >= full  # the untiled MLP does hold (tokens x intermediate): the probe works
    out, grads, saved_t, fwd_t, bwd_t = results[True]
    assert saved_t <= TOKENS * HIDDEN  # only the inputs are saved
    assert fwd_t <= tile and bwd_t <= max(tile, TOKENS * HIDDEN), (fwd_t, bwd_t)
    assert torch.allclose(out, results[False][0], rtol=0, atol=1e-6)
    for a, b in zip(grads, results[False][1]):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-6


def test_tile_mlps_wraps_and_unwraps_a_model():
    # routed experts and a gated shared expert per layer, in float64: the tiling's arithmetic is compared here,
    # not fp32's rounding (which the CP test bounds)
    model = tiny("qwen2_moe").double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    full = batch(seq_len=40)
    want = _loss_grads(model, full)
    assert tile_mlps(model, 7) == 2 * model.config.num_hidden_layers
    assert tile_mlps(model, 7) == 2 * model.config.num_hidden_layers  # idempotent
    got = _loss_grads(model, full)
    # within rounding, not bitwise: the experts' matmuls over a tile's rows round by the CPU's BLAS blocking
    assert rel_err(got[0], want[0]) <= 1e-12
    assert max(rel_err(got[1][n], want[1][n]) for n in want[1]) <= 1e-12
    untile_mlps(model)
    assert "forward" not in vars(model.model.layers[0].mlp.experts)


def test_unknown_mlp_and_dropout_are_refused_by_name():
    model = tiny("llama")

    class MyMLP(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(1)  # mixes tokens: tiling it would be wrong

    model.model.layers[1].mlp = MyMLP()
    with pytest.raises(UnsupportedFeatureError, match="MyMLP"):
        tile_mlps(model, 8)
    gpt2 = tiny("gpt2")
    gpt2.transformer.h[0].mlp.dropout.p = 0.1
    with pytest.raises(UnsupportedFeatureError, match="dropout"):
        tile_mlps(gpt2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_pins_host_memory_and_lowers_peak():
    import transformers

    from longdoc import models

    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                                      max_position_embeddings=65536)
    ids = torch.randint(0, 256, (1, 16384), device="cuda")
    results = {}
    for offload in (False, True):
        model = models.from_config(config, seed=1).cuda()
        model.config.use_cache = False
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        off = offload_checkpoints(model) if offload else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - base
        if off is not None:
            assert off.stats.moved == config.num_hidden_layers
            assert all(e.host.is_pinned() for e in off.live_entries())
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
        results[offload] = (loss.item(), grads, after_forward, peak, off)
        del model, loss
        torch.cuda.empty_cache()
    (l0, g0, f0, p0, _), (l1, g1, f1, p1, off) = results[False], results[True]
    assert l0 == l1 and all(g0[n].equal(g1[n]) for n in g0)
    held = config.num_hidden_layers * 16384 * config.hidden_size * 4  # the layer checkpoints, fp32
    assert f0 - f1 >= 0.9 * held, (f0, f1, held)
    assert p1 < p0, (p0, p1)
    assert off.stats.prefetch_hits == config.num_hidden_layers - 1


@pytest.mark.parametrize("lora", [False, True])
def test_recipe_build_applies_offload_and_tiling(lora):
    import longdoc
    from longdoc.hf.offload import _OffloadedCheckpoint
    from longdoc.train.config import LoraConfig, ModelConfig, ParallelismConfig, TrainConfig
    from longdoc.train.modeling import build

    cp = longdoc.ContextParallel()
    full = batch(seq_len=48)
    runs = []
    for on in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation both times
        model, _ = build(ModelConfig(name="tiny:llama"), LoraConfig(enabled=lora, r=4, dropout=0.0),
                         TrainConfig(), ParallelismConfig(offload_checkpoints=on, tiled_mlp=on, mlp_tile_tokens=8), cp,
                         48)
        base = model.get_base_model() if lora else model
        layer = base.model.layers[0]
        assert isinstance(layer._gradient_checkpointing_func, _OffloadedCheckpoint) == on
        assert ("forward" in vars(layer.mlp)) == on
        runs.append(_loss_grads(model, cp.shard_batch(full)))
    (l0, g0), (l1, g1) = runs
    assert l1.equal(l0) and g1.keys() == g0.keys()
    assert max(((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-30)).item() for n in g0) <= 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_checkpoint_recompute_stops_before_the_tiled_mlp(arch):
    # the tiled backward recomputes the MLP tile by tile; the layer's checkpoint recompute must not run it too
    model = tiny(arch)
    calls = [0]
    tile_mlps(model, 8)
    for mod in model.modules():
        if getattr(mod, "_longdoc_tiled", False):
            inner = mod.forward.inner

            def counting(*args, inner=inner):
                calls[0] += 1
                return inner(*args)

            mod.forward.inner = counting
    loss = model(**batch(seq_len=40)).loss
    forward_calls = calls[0]
    loss.backward()
    assert forward_calls == model.config.num_hidden_layers * 5  # 40 tokens in tiles of 8
    assert calls[0] == 2 * forward_calls  # backward: the tiles once, no second MLP forward in the recompute


def test_tiled_mlp_bench_runs():
    from longdoc.bench import tiled_mlp as bench

    cfg = bench.TiledMlpBenchConfig(seq_len=64, layers=1, repeats=1, tile_tokens=16, vocab_size=256)
    res = bench.run(cfg, log=lambda *a: None)
    assert set(res["median_s"]) == {"untiled", "tiled"} and res["ratio"] > 0
    assert "tiled / untiled" in bench.to_markdown(res)


def test_tiled_mlp_under_bf16_autocast_recomputes_in_bf16():
    # the backward recomputes under the forward's autocast state: the same bf16 forward, gradients at bf16 rounding
    full = batch(seq_len=48)
    runs = []
    for tile in (None, 8):
        model = tiny("llama")
        if tile:
            tile_mlps(model, tile)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**full).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = runs
    assert l1.equal(l0)
    assert max(((g1[n] - g0[n]).abs().max() / g0[n].abs().max()).item() for n in g0) <= 3e-2
