"""The planner's four CP strategies: bytes equal the traffic formulas the distributed tests check against counted
gloo traffic, links follow the group's span (inside a node or across), uneven heads and kernel size cost time,
refusals name the fix, and `longdoc plan` prints its choice with the reason."""

from __future__ import annotations

import pytest

from longdoc.cli import main
from longdoc.parallel.traffic import bytes_sent
from longdoc.plan import strategies
from longdoc.plan.memory import Setup, estimate
from longdoc.plan.planner import PlanRequest, plan
from longdoc.plan.shapes import model_shape
from longdoc.plan.timing import estimate_time


@pytest.mark.parametrize("strategy,cp,u", [("ring", 4, None), ("ulysses", 4, None), ("usp", 8, 4), ("usp", 8, 2)])
def test_bytes_per_layer_equal_the_traffic_formula(strategy, cp, u):
    # Llama-3.1-8B: 32 query / 8 K/V heads split evenly, so every rank sends the same
    tokens, c = 4096, 2
    layer = strategies.attention_layer(strategy, cp=cp, ulysses=u, tokens=tokens, q_heads=32, kv_heads=8,
                                       head_dim=128, c=c, t_fwd=1.0, t_bwd=2.5, bw_span=lambda r: 1e11, lat=0.0)
    want = bytes_sent(strategy, cp_size=cp, seq_len=cp * tokens, q_heads=32, kv_heads=8, head_dim=128, itemsize=c,
                      ulysses_size=u)
    assert (layer.forward_bytes, layer.backward_bytes) == (want.forward, want.backward)


def test_uneven_heads_and_small_kernels_cost_time():
    assert strategies.head_balance(9, 3, 2) == pytest.approx(5 * 2 / 9)  # SmolLM2: 4 + 5 heads
    assert strategies.head_balance(32, 8, 4) == 1.0
    # a ring rank runs zigzag chunks of N/2 tokens; Ulysses one kernel over the whole sequence
    assert strategies.kernel_block("ring", 8, None, 4096) == 2048
    assert strategies.kernel_block("ulysses", 8, None, 4096) == 32768
    assert strategies.kernel_block("usp", 8, 2, 4096) == 4096
    assert strategies.kernel_efficiency(2048, 1024) == pytest.approx(2 / 3)


def _setup(strategy, cp=16, u=None, **kw):
    return Setup(shape=model_shape("Qwen2.5-7B"), seq_len=131072, cp=cp, strategy=strategy, ulysses_size=u,
                 device="h100", **kw)


def test_all_to_all_across_nodes_is_slower_than_inside_one():
    # 16 GPUs = 2 nodes of 8: pure Ulysses all-to-alls cross InfiniBand; usp 8 x 2 keeps them on NVLink and
    # only its ring crosses the nodes (overlapped with compute)
    uly, usp8 = estimate_time(_setup("ulysses")), estimate_time(_setup("usp", u=4 * 2))
    assert uly.seconds["exposed_comm"] > 3 * usp8.seconds["exposed_comm"]
    # ... and inside one node (cp=8), the same all-to-all over NVLink costs a fraction of it
    inside = estimate_time(_setup("ulysses", cp=8))
    assert inside.seconds["exposed_comm"] < uly.seconds["exposed_comm"] / 3


def test_strategy_buffers():
    # all-gather holds the whole sequence's K/V: the largest buffers at cp=16
    bufs = {st: strategies.buffers(st, cp=16, ulysses=u, tokens=8192, q_heads=28, kv_heads=4, head_dim=128, c=2)[0]
            for st, u in (("ring", None), ("allgather", None), ("ulysses", None), ("usp", 4))}
    assert max(bufs, key=bufs.get) == "allgather"
    assert "ring over U*N tokens" in strategies.buffers("usp", cp=16, ulysses=4, tokens=8192, q_heads=28, kv_heads=4,
                                                        head_dim=128, c=2)[1]


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="needs at least 16 query heads, the model has 9"):
        Setup(shape=model_shape("SmolLM2-135M"), seq_len=65536, cp=16, strategy="ulysses", device="h100")
    with pytest.raises(ValueError, match="ulysses_size goes with strategy 'usp'"):
        Setup(shape=model_shape("SmolLM2-135M"), seq_len=65536, cp=4, strategy="usp", device="h100")
    with pytest.raises(ValueError, match="--strategy ulysses is open at no cp"):
        plan(PlanRequest(model="SmolLM2-135M", seq_len=65536, gpus=16, cp=16, strategy="ulysses"))
    with pytest.raises(ValueError, match="--ulysses-size 3 must divide --cp 4"):
        PlanRequest(model="SmolLM2-135M", seq_len=65536, gpus=4, cp=4, strategy="usp", ulysses_size=3)
    # without a pinned cp the cps Ulysses cannot run at are skipped, not refused
    p = plan(PlanRequest(model="SmolLM2-135M", seq_len=65536, gpus=16, strategy="ulysses"))
    assert {c.setup.cp for c in p.candidates} == {1, 2, 4, 8}


def test_plan_prints_the_choice_among_four_strategies_with_its_reason(capsys):
    assert main(["plan", "--model", "Llama-3.1-8B", "--seq-len", "128k", "--gpus", "8", "--cp", "8",
                 "--checkpointing"]) == 0
    out = capsys.readouterr().out
    rec = out.split("RECOMMENDED: ", 1)[1].splitlines()
    assert rec[1].startswith("  why: ")
    for label in ("ring", "allgather", "ulysses", "usp 2x4", "usp 4x2"):
        assert f"{label} " in rec[1] and f"\n  8   1 {label:<10}" in out, label
    assert "GPU figures are formulas" in out
    # the reason's numbers are the candidates' own
    p = plan(PlanRequest(model="Llama-3.1-8B", seq_len=131072, gpus=8, cp=8, checkpointing=True))
    assert p.best is not None and f"{p.best.time.total:.4g} s/step" in p.reason
    assert p.best.time.total == min(c.time.total for c in p.candidates if c.fits)
    assert main(["plan", "--model", "Llama-3.1-8B", "--seq-len", "128k", "--gpus", "8", "--cp", "8",
                 "--strategy", "usp", "--ulysses-size", "2", "--checkpointing"]) == 0
    assert "RECOMMENDED: cp=8 dp=1 usp (Ulysses 2 x ring 4)" in capsys.readouterr().out


def test_labelled_tokens_bound_the_loss_chunk():
    # a QA row: 125 answer tokens in 32,712 (measured on the 19k row of this shape: docs/guides/planning.md)
    base = dict(shape=model_shape("SmolLM2-135M"), seq_len=32712, cp=2, lora=True, loss_chunk=2048, device="cpu",
                precision="bf16", ddp=True)
    qa, every = Setup(**base, loss_tokens=125), Setup(**base)
    assert (qa.chunk, qa.logit_rows, every.chunk, every.logit_rows) == (125, 125, 2048, 16356)
    def loss_term(setup):
        return next(t.bytes for t in estimate(setup).phases["loss"] if t.label.startswith("loss chunk"))

    assert (loss_term(qa), loss_term(every)) == (12 * 125 * 49152, 12 * 2048 * 49152)  # 12*C*V: 0.07 vs 1.12 GiB
    assert estimate(qa).total < estimate(every).total
    assert estimate_time(qa).flops["dense"] < estimate_time(every).flops["dense"]
    # without the chunked loss every token's logits are built, labels or not
    assert Setup(**{**base, "loss_chunk": None}, loss_tokens=125).chunk == 16356
    with pytest.raises(ValueError, match="loss_tokens must be positive"):
        Setup(**base, loss_tokens=0)
