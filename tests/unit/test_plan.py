"""The planner: parameter and activation formulas against real models, the torchtitan anchor, recommendations."""

from __future__ import annotations

import json

import pytest

import longdoc
from longdoc import models
from longdoc.plan.hardware import GIB
from longdoc.plan.memory import Setup, estimate, layer_bytes_per_token
from longdoc.plan.planner import PlanRequest, longest_fitting, plan
from longdoc.plan.shapes import ModelShape, model_shape, shape_from_config
from longdoc.plan.timing import estimate_time
from tests.support.saved_tensors import SMALL, saved_bytes_per_token

PUBLISHED = {"Llama-3.1-8B": 8_030_261_248, "Llama-3.1-70B": 70_553_706_496, "Qwen2.5-7B": 7_615_616_512,
             "SmolLM2-135M": 134_515_008}


def llama_formula_params(shape: ModelShape) -> int:
    """The hand formula of longdoc.plan.shapes' docstring (Llama-shaped models without biases)."""
    h, q, kv, i = shape.hidden, shape.q, shape.kv, shape.intermediate
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return shape.layers * per_layer + shape.vocab * h * (1 if shape.tied else 2) + h


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_and_the_hand_formula(name):
    shape = model_shape(name)
    assert shape.params.total == PUBLISHED[name]
    biases = shape.layers * (shape.q + 2 * shape.kv) if shape.model_type == "qwen2" else 0  # q/k/v biases
    assert llama_formula_params(shape) + biases == shape.params.total


def test_names_resolve_offline_and_errors_say_what_exists():
    assert model_shape("meta-llama/Llama-3.1-8B").hidden == 4096
    assert model_shape("SmolLM2-135M-Instruct").tied
    with pytest.raises(ValueError, match="Llama-3.1-70B"):
        model_shape("./no/such/config.json")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma", "phi3", "stablelm"])
def test_activation_formula_equals_what_the_patched_model_saves(arch):
    model = models.tiny_model(arch, **SMALL)
    shape = shape_from_config(model.config)
    longdoc.patch(model, longdoc.ContextParallel())
    got = saved_bytes_per_token(model)
    # the layer also holds RoPE's cos/sin, which every layer shares (one term of the plan)
    want = layer_bytes_per_token(shape, 4) + 2 * shape.rotary_dim * 4
    # Gemma's norms save (1 + weight) once per layer: a constant, not per token
    assert got == pytest.approx(want, abs=2 * shape.hidden * 4 / 256), (got, want)


def test_activation_formula_with_lora():
    from peft import LoraConfig, get_peft_model

    model = models.tiny_model("llama", **SMALL)
    shape = shape_from_config(model.config)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    longdoc.patch(model, longdoc.ContextParallel())
    want = layer_bytes_per_token(shape, 4, lora=True, lora_rank=8) + 2 * shape.rotary_dim * 4
    assert saved_bytes_per_token(model) == pytest.approx(want)
    assert want < layer_bytes_per_token(shape, 4)


def _anchor() -> Setup:
    # torchtitan (docs/performance.md, Table 2): Llama-3.1-8B, 131072 tokens, 8 H100, FSDP over all 8 with
    # CP=4, full activation checkpointing, plain cross-entropy (no chunking): "Memory 84.0 GiB" (reserved).
    return Setup(shape=model_shape("Llama-3.1-8B"), seq_len=131072, cp=4, dp=2, checkpointing=True,
                 loss_chunk=None, device="h100")


def test_torchtitan_anchor_breakdown_by_hand():
    est = _anchor()
    m = estimate(est)
    p, n, h, v = 8_030_261_248, 131072 // 4, 4096, 128_256
    terms = {t.label: t.bytes for t in m.terms}
    assert m.peak_phase == "loss"
    assert terms["weights"] == p * 4 / 8  # fp32 master shard: 3.74 GiB
    assert terms["AdamW moments"] == 2 * p * 4 / 8  # 7.48 GiB
    assert terms["checkpoints (32 layers)"] == 32 * n * h * 2 == 8 * GIB  # bf16 layer inputs
    assert terms["loss chunk (fp32 log-probs, their grad, logits grad)"] == 12 * n * v  # 46.97 GiB
    assert terms["FSDP root unit (embedding, lm_head, norm)" " gathered"] == (2 * 525_336_576 + 4096) * 2
    print(f"planner: {m.allocator_gib:.1f} GiB allocator-visible (torchtitan: 84.0 GiB reserved), "
          f"{m.total_gib:.1f} GiB with the CUDA runtime")
    assert 0.85 * 84.0 <= m.allocator_gib <= 1.15 * 84.0
    assert m.total_gib <= 79.65  # it does run on an 80 GB H100 (torchtitan used 96 GB cards)


def test_chunked_loss_removes_the_logits_peak():
    import dataclasses

    full = estimate(_anchor())
    chunked = estimate(dataclasses.replace(_anchor(), loss_chunk=1024))
    assert chunked.peak_phase == "backward"
    assert chunked.total_gib < 0.55 * full.total_gib


def test_activation_memory_falls_like_one_over_cp():
    shape = model_shape("Llama-3.1-8B")
    acts = {}
    for cp in (1, 2, 4, 8):
        m = estimate(Setup(shape=shape, seq_len=65536, cp=cp, dp=8 // cp, checkpointing=True))
        acts[cp] = m.breakdown["activations"] + m.breakdown["comm_buffers"]
        state = m.breakdown["weights"] + m.breakdown["optimizer"]
        assert state == pytest.approx(12 * shape.params.total / 8)  # FSDP over all 8 GPUs for every cp
    for cp in (2, 4):
        assert acts[cp] * cp == pytest.approx(acts[1], rel=0.02)
    # at cp=8 the worst moment is the backward of layer 0 (every gradient, one checkpoint): still less
    assert acts[8] * 8 < acts[1]


def test_step_time_flops_by_hand_and_overlap():
    shape = model_shape("Llama-3.1-8B")
    s = Setup(shape=shape, seq_len=131072, cp=4, dp=2, checkpointing=True)
    t = estimate_time(s, "nvlink")
    n = 131072 // 4
    assert t.flops["dense"] == pytest.approx(6 * n * shape.params.matmul)
    assert t.flops["attention"] == pytest.approx(32 * 3.5 * 2 * 131072**2 * 4096 / 4)
    assert t.seconds["exposed_comm"] < 0.01 * t.total  # NVLink ring hides behind 32k-token blocks
    slow = estimate_time(Setup(shape=shape, seq_len=131072, cp=4, dp=2, layout="contiguous"), "nvlink")
    assert slow.total > t.total
    ib = estimate_time(s, "ib")
    assert ib.total >= t.total
    short = estimate_time(Setup(shape=shape, seq_len=4096, cp=8, dp=1), "ib")
    assert short.seconds["exposed_comm"] > 0  # tiny blocks cannot hide their messages


def test_plan_recommends_a_fitting_configuration():
    p = plan(PlanRequest(model="Llama-3.1-8B", seq_len=131072, gpus=8, gpu="h100"))
    assert p.best is not None and p.best.fits
    assert p.best.setup.cp * p.best.setup.dp == 8
    assert not any(c.fits and c.setup.cp < p.best.setup.cp
                   and c.time.tokens_per_s > p.best.time.tokens_per_s * 1.03 for c in p.candidates)
    from longdoc.plan.report import render_plan

    text = render_plan(p)
    assert "RECOMMENDED" in text and "P*4/S = 8,030,261,248*4/8" in text


def test_plan_says_when_it_cannot_fit_and_what_to_change():
    p = plan(PlanRequest(model="Llama-3.1-8B", seq_len=524288, gpus=8, gpu="h100", checkpointing=False))
    assert p.best is None
    text = " ".join(p.suggestions)
    assert "--checkpointing" in text and "GiB" in text
    huge = plan(PlanRequest(model="Llama-3.1-70B", seq_len=1 << 20, gpus=8, gpu="a100"))
    assert huge.best is None
    assert any("GPUs" in s for s in huge.suggestions)
    assert any("alone" in s for s in huge.suggestions)  # 16 bytes/param over 8 GPUs exceed 80 GB


def test_longest_fitting_is_monotone():
    req = PlanRequest(model="SmolLM2-135M", seq_len=1 << 20, gpus=2, gpu="cpu", memory_gib=4.0)
    longest = longest_fitting(req)
    assert 0 < longest < 1 << 20
    import dataclasses

    assert plan(dataclasses.replace(req, seq_len=longest)).best is not None
    assert plan(dataclasses.replace(req, seq_len=longest + 1024)).best is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(cp=3), "must divide"), (dict(cp=2, dp=2), "must equal"), (dict(gpu="v100"), "h100"),
    (dict(strategy="tree"), "ring"), (dict(interconnect="pcie"), "nvlink"),
])
def test_request_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanRequest(model="Llama-3.1-8B", seq_len=8192, gpus=8, **kwargs)


def test_cli_json_and_exit_codes(capsys):
    from longdoc.cli import main

    assert main(["plan", "--model", "Llama-3.1-8B", "--seq-len", "131072", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["recommended"]["terms"][0]["formula"].startswith("P*4/S")
    assert main(["plan", "--model", "Llama-3.1-70B", "--seq-len", "1048576", "--gpus", "8", "--gpu", "a100"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", "--model", "Llama-3.1-8B", "--seq-len", "8192", "--gpus", "8", "--cp", "3"]) == 2
