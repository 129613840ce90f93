"""The linear-attention and recurrent kinds in one process: every family's mixers are matched explicitly (RWKV and
xLSTM have no layer_types), a one-rank patch (zigzag: two pieces per row, composed by state passing) equals the
unpatched model, and what stays refused names itself."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import longdoc
from longdoc.hf import UnsupportedFeatureError, kinds, patch
from tests.support.hf_hybrids_linear import FAMILIES, linear_config, linear_model, linear_pair

EXPECTED = {"qwen3_next": "gated_deltanet", "qwen3_5_text": "gated_deltanet", "qwen3_5_moe_text": "gated_deltanet",
            "olmo_hybrid": "gated_deltanet", "lara_mini": "gated_deltanet", "qwen4_exp_text": "gated_deltanet",
            "kimi_linear": "kda", "bailing_hybrid": "kda", "glm5_next": "kda", "minimax": "lightning",
            "recurrent_gemma": "rglru", "rwkv": "rwkv", "xlstm": "xlstm"}


def test_every_family_is_listed():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_mixers_are_matched_explicitly(arch):
    config = linear_config(arch)
    with torch.device("meta"):
        model = linear_model(arch, config)
    assert {k.name for _, _, k in kinds.find(model)} == {EXPECTED[arch]}
    assert kinds.unknown_mixers(model) == [] and kinds.problems(model, None) is None


@pytest.mark.parametrize("arch", ["rwkv", "xlstm", "minimax"])  # no layer_types / a mixer written around the scan
def test_a_one_rank_patch_is_exact(arch):
    ref, model = linear_pair(arch)
    cp = longdoc.ContextParallel()
    patch(model, cp)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    want = ref(input_ids=ids, labels=ids)
    got = model(**cp.shard_batch({"input_ids": ids, "labels": ids}))
    assert sum(model._longdoc_cp.kind_calls.values()) == sum(kinds.expected_calls(model).values())
    assert (got.logits - want.logits).abs().max() <= 1e-4
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5


def _qwen4(**overrides):
    config = AutoConfig.for_model("qwen4_exp_text", **{**FAMILIES["qwen4_exp_text"], "hidden_size": 64,
                                                      "intermediate_size": 128, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "vocab_size": 256, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_qwen4_exp_ngram_embedding_is_refused_by_name():
    model = _qwen4(ple_layer_ids=[1], ngram_vocab_size_base=1000, eos_token_id=255)
    with pytest.raises(UnsupportedFeatureError, match="n-gram embedding .* token halo"):
        patch(model, longdoc.ContextParallel())


def test_qwen4_exp_indexed_attention_is_refused_by_name():
    model = _qwen4(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                   indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    with pytest.raises(UnsupportedFeatureError, match="indexed_attention|Indexer|QSA indexer"):
        patch(model, longdoc.ContextParallel())
