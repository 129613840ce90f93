"""Sparse indexed attention (DSA) in one process (CP size 1): every family patched equals transformers, the
selection API of the CP core, and DeepSeek-V4's compressed attention refused by name. The multi-rank exactness
is tests/dist/test_hf_dsa.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import longdoc
from longdoc.hf import UnsupportedFeatureError, kinds, patch
from tests.support.hf_dsa import TESTED, TOPK, dsa_pair
from tests.support.hf_families import GRAD_TOL


@pytest.fixture
def cp():
    return longdoc.ContextParallel()


@pytest.mark.parametrize("arch", TESTED)
def test_patched_dsa_family_equals_transformers_at_size_one(arch, cp):
    ref, model = dsa_pair(arch)
    patch(model, cp)
    assert {k.name for _, _, k in kinds.find(model)} == {"dsa_indexer"}
    ids = torch.randint(0, 256, (2, 4 * TOPK + 3), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    out = model(**cp.shard_batch({"input_ids": ids, "labels": ids}))
    out.loss.backward()
    assert (out.logits[:, :ids.shape[1]] - want.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name  # the indexer's weights get no gradient, as in HF
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max() <= GRAD_TOL * q.grad.abs().max().clamp_min(1e-6), name


def test_selected_keys_are_checked(cp):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"selected must be of shape \(batch, local_len, n\)"):
        longdoc.attention(q, q, q, cp, selected=torch.zeros(1, 7, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="selected must be an integer tensor"):
        longdoc.attention(q, q, q, cp, selected=torch.zeros(1, 8, 3))


def test_selected_keys_match_masked_attention(cp):
    """Every query sees exactly its selected earlier keys; unused slots (-1), repeats and future keys ignored."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sel = torch.randint(-1, 12, (2, 12, 4), generator=g)
    sel[..., 0] = torch.arange(12)
    seen = (sel.unsqueeze(-1) == torch.arange(12)).any(2) & torch.ones(12, 12, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen.unsqueeze(1))
    got = longdoc.attention(q, k, v, cp, selected=sel)
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("layer_type,name", [("heavily_compressed_attention", "heavily compressed"),
                                             ("compressed_sparse_attention", "compressed sparse")])
def test_deepseek_v4_compressed_attention_is_refused_by_name(cp, layer_type, name):
    config = AutoConfig.for_model("deepseek_v4", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  head_dim=16, q_lora_rank=16, vocab_size=256, index_topk=4, index_head_dim=8,
                                  index_n_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  o_groups=2, o_lora_rank=8, sliding_window=8, num_hash_layers=0,
                                  layer_types=["sliding_attention", layer_type])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedFeatureError, match=f"DeepSeek-V4 {name} attention .*not built under CP yet"):
        patch(model, cp)


@pytest.mark.parametrize("arch,what", [("glm5_next", "GLM-5-Next's pooled DSA indexer"),
                                       ("qwen4_exp", "Qwen4-Exp's QSA indexer")])
def test_pooled_indexers_are_refused_by_name(cp, arch, what):
    from transformers import AutoModelForImageTextToText

    from tests.support.hf_dsa import _COMMON

    text = dict(_COMMON, qk_rope_head_dim=0, layer_types=["full_attention"] * 3, pad_token_id=0, index_kpool=4,
                indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2)
    config = AutoConfig.for_model(arch, text_config=text)
    with torch.device("meta"):  # Qwen4-Exp has a causal LM; GLM-5-Next only its image-text model, used on text
        model = (AutoModelForCausalLM if arch == "qwen4_exp" else AutoModelForImageTextToText).from_config(config)
    with pytest.raises(UnsupportedFeatureError, match=f"{what} .*not built under CP yet"):
        patch(model, cp)
