"""longdoc.plan.prefill: one rank's memory in `longdoc ask`'s CP prefill, term by term, checked against the
formulas worked by hand from SmolLM2-135M's published config, and against the tensors a real prefill keeps."""

from __future__ import annotations

import json

import pytest

from longdoc.plan.prefill import prefill_bytes, prefill_terms, rank_tokens
from longdoc.plan.shapes import CONFIG_DIR, model_shape

GIB = 2**30


def _by_label(terms) -> dict[str, float]:
    return {t.label.split(" (")[0]: t.bytes for t in terms}


@pytest.mark.parametrize(("dtype", "w"), [("float32", 4), ("bfloat16", 2)])
@pytest.mark.parametrize(("tokens", "cp", "n"), [(10_000, 4, 2_500), (10_001, 4, 2_502), (10_001, 1, 10_002)])
def test_the_terms_of_smollm2_by_hand(dtype, w, tokens, cp, n):
    c = json.loads((CONFIG_DIR / "SmolLM2-135M.json").read_text())
    h, i, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    q, kv, heads = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], \
        c["num_attention_heads"]
    assert rank_tokens(tokens, cp) == n  # zigzag pads to a multiple of 2*cp (2 at cp=1)
    got = _by_label(prefill_terms(model_shape("SmolLM2-135M"), tokens, cp, dtype=dtype))
    mlp = 3 * w * n * i  # act, up, their product
    attention = n * (3 * q * w + 12 * q) + 8 * n * heads + (2 if cp > 1 else 1) * 2 * n * kv * w
    assert (mlp > attention) == (w == 4)  # in bf16 the fp32 accumulators make the attention the larger
    assert got == {
        "weights": 134_515_008 * w,  # the published parameter count (tests/unit/test_plan.py), tied embedding
        "KV cache": layers * 2 * n * kv * w,
        "rotary cos/sin": 2 * n * c["head_dim"] * w,
        "layer forward": 3 * n * h * w + max(mlp, attention),
        "logits": vocab * (w + 4),
        "runtime": 0.49 * GIB,
    }


def test_other_strategies_price_their_buffers_and_the_cpu_runtime_is_not_the_gpus():
    shape = model_shape("SmolLM2-135M")
    ring = prefill_bytes(shape, 1 << 20, 8)
    assert prefill_bytes(shape, 1 << 20, 8, strategy="allgather") > ring  # the whole sequence's K/V gathered
    assert prefill_bytes(shape, 1 << 20, 8, gpu=True) - ring == pytest.approx((1.5 - 0.49) * GIB)
    with pytest.raises(ValueError, match="dtype must be one of"):
        prefill_terms(shape, 10, 1, dtype="fp8")


def test_the_estimate_covers_the_tensors_a_real_prefill_keeps():
    """A tiny model's prefill in one process (fp32, cp=1; its attention outweighs its MLP): the bytes of the tensor
    storages alive at its peak, besides the weights, are the estimate's, weights and runtime left out, within 5%."""
    import torch

    import longdoc
    from longdoc.bench.kinds_memory import LiveBytes
    from longdoc.hf.session import KVSession
    from longdoc.models import tiny_model

    model = tiny_model("llama").eval()
    shape = model_shape("tiny:llama")
    tokens = 2048
    ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))
    with KVSession(model, longdoc.ContextParallel()) as session:
        with LiveBytes(list(model.parameters()) + list(model.buffers()), owner=lambda: "") as live:
            session.prefill(ids)
    priced = prefill_terms(shape, tokens, 1)
    assert "layer forward (attention)" in [t.label for t in priced]
    terms = _by_label(priced)
    estimate = sum(terms.values()) - terms["runtime"] - terms["weights"]
    assert 0.95 * estimate < live.peak <= 1.05 * estimate, (live.peak, terms)
