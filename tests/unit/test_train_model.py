"""Model building: RoPE extension, LoRA, context-length check, export that loads with plain transformers."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.train.config import LoraConfig, ModelConfig, ParallelismConfig, RecipeError, TrainConfig
from longdoc.train.modeling import build, export

_PAR = ParallelismConfig()  # one process: nothing sharded, offloaded or tiled


def _cp():
    return longdoc.ContextParallel()


def test_yarn_extension_is_applied_before_the_rotary_embedding_is_built():
    tiny = {"max_position_embeddings": 1024}
    base, _ = build(ModelConfig(name="tiny:llama", overrides=tiny), LoraConfig(), TrainConfig(), _PAR, _cp(), 512)
    ext, _ = build(ModelConfig(name="tiny:llama", overrides=tiny, rope_type="yarn", rope_factor=4.0),
                   LoraConfig(), TrainConfig(), _PAR, _cp(), 4096)
    rp = ext.config.rope_parameters
    assert (rp["rope_type"], rp["factor"], rp["original_max_position_embeddings"]) == ("yarn", 4.0, 1024)
    assert ext.config.max_position_embeddings == 4096
    assert not torch.equal(base.model.rotary_emb.inv_freq, ext.model.rotary_emb.inv_freq)
    with pytest.raises(RecipeError, match=r"data.seq_len=4096 exceeds.*1024.*model.rope_type=yarn model.rope_factor=4"):
        build(ModelConfig(name="tiny:llama", overrides=tiny), LoraConfig(), TrainConfig(), _PAR, _cp(), 4096)


def test_lora_trains_adapters_only_and_exports_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = build(ModelConfig(name="tiny:llama"), LoraConfig(enabled=True, r=4), TrainConfig(), _PAR, _cp(), 128)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # make the adapter change the function
    ids = torch.arange(32)[None]
    pos = torch.arange(32)[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
    export(model, tok, tmp_path / "final", merge_lora=True)
    assert (tmp_path / "final" / "model.safetensors").is_file()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert plain.config._attn_implementation != "longdoc_cp"
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_lora_target_typo_lists_the_linear_layers():
    with pytest.raises(RecipeError, match=r"\['qproj'\] not found.*'q_proj'"):
        build(ModelConfig(name="tiny:llama"), LoraConfig(enabled=True, target_modules=["qproj"]), TrainConfig(),
              _PAR, _cp(), 128)
