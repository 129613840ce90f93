"""longdoc.patch in one process (CP size 1): exactness, and every refusal with its error text."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import longdoc
from longdoc import models
from longdoc.hf import CPInputError, UnsupportedFeatureError, is_patched, patch, unpatch
from longdoc.hf.attention import NAME, cp_attention_forward

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)


@pytest.fixture
def cp():
    return longdoc.ContextParallel()


def _ids(length=20, bsz=1, seed=0):
    return torch.randint(0, 256, (bsz, length), generator=torch.Generator().manual_seed(seed))


def _run(model, cp, ids, **extra):
    batch = {"input_ids": ids, "labels": ids, **extra}
    return model(**cp.shard_batch(batch))


def _refuses(match, fn, *args, **kwargs):
    with pytest.raises(UnsupportedFeatureError, match=match):
        fn(*args, **kwargs)


# ---- exactness and mechanics ----

@pytest.mark.parametrize("arch", models.TINY_ARCHS)
def test_patched_equals_sdpa_at_size_one(arch, cp):
    ids = _ids(21, bsz=2)
    ref = models.tiny_model(arch)(input_ids=ids, labels=ids)
    model = patch(models.tiny_model(arch), cp)
    assert model.config._attn_implementation == NAME
    out = _run(model, cp, ids)
    assert (out.logits[:, :21] - ref.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6


def test_registration_adds_a_name_and_keeps_sdpa(cp):
    sdpa_attn, sdpa_mask = AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"]
    patch(models.tiny_model("llama"), cp)
    assert AttentionInterface._global_mapping[NAME] is cp_attention_forward
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attn
    assert AttentionMaskInterface._global_mapping["sdpa"] is sdpa_mask
    # an unpatched model in the same process still runs sdpa
    assert models.tiny_model("llama").config._attn_implementation == "sdpa"


def test_an_existing_foreign_name_is_never_overwritten(cp):
    patch(models.tiny_model("llama"), cp)  # registers ours
    AttentionInterface._global_mapping[NAME] = lambda *a, **k: None
    try:
        with pytest.raises(RuntimeError, match="already has a function named 'longdoc_cp'"):
            patch(models.tiny_model("llama"), cp)
    finally:
        AttentionInterface._global_mapping[NAME] = cp_attention_forward


def test_no_full_length_mask_is_built(cp, monkeypatch):
    import transformers.masking_utils as mu

    def boom(*a, **k):
        raise AssertionError("a dense mask was built")

    for name in ("sdpa_mask", "eager_mask"):
        monkeypatch.setattr(mu, name, boom)
    monkeypatch.setitem(mu.AttentionMaskInterface._global_mapping, "sdpa", boom)
    model = patch(models.tiny_model("mistral", sliding_window=64), cp)
    ids = _ids(20, bsz=2)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    _run(model, cp, ids, attention_mask=mask).loss.backward()
    model(input_ids=ids[:, :20], position_ids=torch.arange(20)[None], attention_mask=mask)  # mask passed directly


def test_unpatch_restores_sdpa_and_loss(cp):
    model = models.tiny_model("qwen3")
    ids = _ids()
    ref = model(input_ids=ids, labels=ids).loss
    patch(model, cp)
    assert is_patched(model)
    unpatch(model)
    assert not is_patched(model) and model.config._attn_implementation == "sdpa"
    assert "_loss_function" not in model.__dict__
    assert torch.equal(model(input_ids=ids, labels=ids).loss, ref)


def test_patching_twice_and_deepcopy_and_pickle(cp):
    model = patch(patch(models.tiny_model("llama"), cp), cp)
    assert len(model._forward_pre_hooks) == 1
    ids = _ids()
    twin = copy.deepcopy(model)
    assert torch.equal(_run(twin, cp, ids).loss, _run(model, cp, ids).loss)
    unpatch(twin)  # removes the copy's hooks, not the original's
    assert not twin._forward_pre_hooks and not twin._forward_hooks and len(model._forward_pre_hooks) == 1
    assert twin.config._attn_implementation == "sdpa"
    revived = pickle.loads(pickle.dumps(model))
    with pytest.raises(RuntimeError, match="call longdoc.patch"):
        _run(revived, cp, ids)


def test_peft_style_wrapper_is_patched_through(cp):
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    ids = _ids()
    ref = models.tiny_model("llama")(input_ids=ids, labels=ids).loss
    wrapped = patch(Wrapper(models.tiny_model("llama")), cp)
    assert abs(_run(wrapped, cp, ids).loss.item() - ref.item()) <= 1e-6


def test_prefill_at_size_one(cp):
    from longdoc.hf.prefill import gather_positions, prefill, span_logprobs

    ids = _ids(19)
    ref = models.tiny_model("gemma")(input_ids=ids).logits
    model = patch(models.tiny_model("gemma"), cp)
    local = prefill(model, cp, {"input_ids": ids})
    assert (local[:, :19] - ref).abs().max() <= 1e-5
    picked = prefill(model, cp, {"input_ids": ids}, positions=[18, 3])
    assert (picked - ref[:, [18, 3]]).abs().max() <= 1e-5
    assert torch.equal(gather_positions(local, cp, [18, 3]), local[:, [18, 3]])
    lp = span_logprobs(model, cp, {"input_ids": ids}, 15, 19)
    want = torch.log_softmax(ref[0, 14:18], -1).gather(1, ids[0, 15:19, None]).squeeze(1)
    assert (lp[0] - want).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="positions must lie in"):
        prefill(model, cp, {"input_ids": ids}, positions=[19])
    with pytest.raises(ValueError, match="needs a model patched for CP"):
        prefill(models.tiny_model("gemma"), cp, {"input_ids": ids})


# ---- refusals: config features (at patch time) ----

def _eager_pair(arch: str, **overrides):
    """(reference, model to patch): one random-init model and its deep copy, eager attention (the
    reference implementation of soft-capping, windows and chunks in transformers)."""
    config = AutoConfig.for_model(arch, **{**TINY, "initializer_range": 0.1, **overrides})
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return ref, copy.deepcopy(ref)


def test_softcapping_is_exact_and_read_per_call(cp):
    ref, model = _eager_pair("gemma2", attn_logit_softcapping=5.0, sliding_window=64)
    patch(model, cp)
    ids = _ids(20)
    want = ref(input_ids=ids, labels=ids)
    assert abs(_run(model, cp, ids).loss.item() - want.loss.item()) <= 1e-5
    # the cap is read at call time: changing it on the modules changes both models alike
    for m in (*ref.modules(), *model.modules()):
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = 0.05
    capped = ref(input_ids=ids, labels=ids).loss
    assert abs(capped.item() - want.loss.item()) > 1e-3  # the cap matters at this size
    assert abs(_run(model, cp, ids).loss.item() - capped.item()) <= 1e-5


def test_refuses_alibi(cp):
    config = AutoConfig.for_model("falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                  vocab_size=256, alibi=True)
    _refuses(r"FalconForCausalLM uses ALiBi position biases", patch, AutoModelForCausalLM.from_config(config), cp)


def test_refuses_bidirectional(cp):
    model = models.tiny_model("llama")
    model.config.is_causal = False
    _refuses("LlamaForCausalLM uses non-causal \\(bidirectional\\) attention", patch, model, cp)
    model = patch(models.tiny_model("llama"), cp)
    model.model.layers[1].self_attn.is_causal = False
    _refuses("non-causal \\(bidirectional\\) attention", _run, model, cp, _ids())


def test_refuses_other_layer_kinds_and_unusable_chunks(cp):
    model = models.tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    _refuses("uses layers of type 'linear_attention'", patch, model, cp)
    model = models.tiny_model("llama")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    _refuses(r"chunked attention layers without a valid attention_chunk_size \(None\)", patch, model, cp)


@pytest.mark.parametrize("arch,overrides,says", [
    # Mamba, Gated DeltaNet (Qwen3-Next) and short-conv (LFM2) layers now have kinds (longdoc.hf.kinds); Qwen4-exp's
    # indexed attention layers are refused by the name of their real blocker, the QSA indexer (kinds/compressed.py)
    ("qwen4_exp_text", {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2,
                        "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                        "indexer_compress_ratio": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
     r"Qwen4ExpForCausalLM uses Qwen4-Exp's QSA indexer .*not built under CP yet"),
])
def test_refuses_layer_types_no_kind_covers_by_name(cp, arch, overrides, says):
    config = AutoConfig.for_model(arch, **TINY, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _refuses(says, patch, model, cp)


def test_llama4_temperature_tuning_is_exact(cp):
    """NoPE layers' query scale from each token's index (a scale that changes every 2 tokens)."""
    ref, model = _eager_pair("llama4_text", attention_chunk_size=6, no_rope_layers=[1, 0], attn_temperature_tuning=True,
                             floor_scale=2, attn_scale=0.5, intermediate_size_mlp=128, num_local_experts=2)
    patch(model, cp)
    ids = _ids(21)
    want = ref(input_ids=ids, labels=ids)
    out = _run(model, cp, ids)
    assert (out.logits[:, :21] - want.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6
    assert model.model.layers[1].self_attn.attn_temperature_tuning  # the module is left as it was


def test_chunked_attention_is_exact(cp):
    ref, model = _eager_pair("llama4_text", attention_chunk_size=6, no_rope_layers=[1, 0],
                             attn_temperature_tuning=False, intermediate_size_mlp=128, num_local_experts=2)
    assert ref.config.layer_types[0] == "chunked_attention"
    patch(model, cp)
    ids = _ids(21)
    want = ref(input_ids=ids, labels=ids)
    out = _run(model, cp, ids)
    assert (out.logits[:, :21] - want.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_router_aux_loss_equals_transformers(arch, cp):
    """output_router_logits=True: loss and aux loss (padding left out of the router statistics) and gradients."""
    ref = models.tiny_model(arch, output_router_logits=True, router_aux_loss_coef=0.5)
    model = patch(copy.deepcopy(ref), cp)
    ids = _ids(21, bsz=2)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    want = ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    want.loss.backward()
    out = model(**cp.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}))
    out.loss.backward()
    assert abs(out.aux_loss.item() - want.aux_loss.item()) <= 1e-6
    assert abs(out.loss.item() - want.loss.item()) <= 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max() <= 1e-6


def test_refuses_a_router_loss_of_its_own(cp):
    config = AutoConfig.for_model("doge", **TINY, num_experts=16, num_experts_per_tok=2, is_moe=True,
                                  output_router_logits=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _refuses(r"an MoE router auxiliary loss of its own \(.*doge", patch, model, cp)


# ---- refusals: per call ----

def test_sliding_window_shorter_than_the_sequence_is_exact(cp):
    model = patch(models.tiny_model("mistral", sliding_window=5), cp)
    ids = _ids(20)
    ref = models.tiny_model("mistral", sliding_window=5)(input_ids=ids, labels=ids)
    full = models.tiny_model("mistral")(input_ids=ids, labels=ids)
    assert abs(ref.loss.item() - full.loss.item()) > 1e-4  # the window matters at this length
    out = _run(model, cp, ids)
    assert (out.logits[:, :20] - ref.logits).abs().max() <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-6


def test_refuses_custom_4d_mask(cp):
    model = patch(models.tiny_model("llama"), cp)
    local = cp.shard_batch({"input_ids": _ids(), "labels": _ids()})
    mask4d = torch.ones(1, 1, 20, 20, dtype=torch.bool).tril()
    _refuses(r"LlamaForCausalLM uses a custom 4-D attention mask", model, **local, attention_mask=mask4d)
    # and straight at the attention function (e.g. a model that builds its own 4-D mask)
    q = torch.randn(1, 4, 20, 16)
    _refuses(r"a custom 4-D attention mask \(1, 1, 20, 20\)", cp_attention_forward,
             model.model.layers[0].self_attn, q, q[:, :2], q[:, :2], mask4d)


def test_refuses_attention_dropout_in_training_only(cp):
    model = patch(models.tiny_model("llama", attention_dropout=0.1), cp)
    model.train()
    _refuses(r"attention dropout in training mode \(p=0.1\)", _run, model, cp, _ids())
    model.eval()
    _run(model, cp, _ids())


def test_refuses_left_padding_passed_to_the_model(cp):
    model = patch(models.tiny_model("llama"), cp)
    ids = _ids(20)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    local = cp.shard_batch({"input_ids": ids})
    _refuses("left padding or holes in attention_mask", model, **local, attention_mask=mask)


def test_left_padding_through_shard_batch_is_exact(cp):
    model = patch(models.tiny_model("llama"), cp)
    ids = _ids(20, bsz=2)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    out = _run(model, cp, ids, attention_mask=mask)
    # reference: each row alone without its pads, every token at its position in the padded row
    ref = models.tiny_model("llama")
    labels = ids.clone()
    labels[1, :7] = -100  # pads, and the first real token (a pad would predict it)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    row1 = ref(input_ids=ids[1:, 6:], position_ids=torch.arange(6, 20)[None]).logits
    assert abs(out.loss.item() - want.item()) <= 1e-5
    assert (out.logits[1, :14] - row1[0]).abs().max() <= 1e-5  # rolled: the real tokens come first


def test_refuses_inputs_not_built_by_shard_batch(cp):
    model = patch(models.tiny_model("llama"), cp)
    ids = _ids(20)

    def bad(match, **kw):
        with pytest.raises(CPInputError, match=f"LlamaForCausalLM was called with {match}"):
            model(**kw)

    bad("no position_ids under context parallelism", input_ids=ids)
    bad("position_ids that are not this rank's global positions", input_ids=ids,
        position_ids=torch.arange(20).flip(0)[None])
    model(input_ids=ids, position_ids=torch.arange(3, 23)[None])  # a row numbered from another start is fine
    bad("labels without shift_labels", input_ids=ids, position_ids=torch.arange(20)[None], labels=ids)
    bad("shift_labels without num_items_in_batch", input_ids=ids, position_ids=torch.arange(20)[None],
        labels=ids, shift_labels=ids)
    bad(r"a local sequence of 19 tokens", input_ids=ids[:, :19], position_ids=torch.arange(19)[None])


def test_refuses_decoding_with_a_kv_cache(cp):
    model = patch(models.tiny_model("llama"), cp)
    local = cp.shard_batch({"input_ids": _ids(20)})
    out = model(**local, use_cache=True)
    _refuses("a filled KV cache", model, input_ids=_ids(1), position_ids=torch.tensor([[20]]),
             cache=out.cache)


def test_refuses_position_dependent_rope_scaling_beyond_its_threshold(cp):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = patch(models.tiny_model("llama", rope_parameters=rope, max_position_embeddings=16), cp)
    _refuses(r"RoPE scaling 'dynamic' at 20 tokens \(beyond its 16-token threshold\)", _run, model, cp, _ids(20))
    _run(model, cp, _ids(16))


def test_refuses_models_whose_attention_bypasses_the_interface(cp):
    model = patch(models.tiny_model("llama"), cp)
    # one layer reads a config that still says "sdpa": its attention bypasses the CP path
    attn = model.model.layers[1].self_attn
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation_internal = "sdpa"
    with pytest.raises(RuntimeError, match="only 1 of 2 layers .* NOT context-parallel-exact"):
        _run(model, cp, _ids())


_DECODER_ONLY = dict(d_model=64, decoder_layers=1, encoder_layers=1, decoder_attention_heads=4,
                     encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, vocab_size=256,
                     max_position_embeddings=128)


@pytest.mark.parametrize("arch", ["bart", "mbart", "pegasus", "blenderbot-small"])
def test_refuses_encoder_decoder_causal_lm_decoders_at_patch_time(cp, arch):
    """They compute their loss themselves (not through model.loss_function) and number positions by the call's
    token index: refused before anything runs (a KV session too), never halfway through a forward."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **_DECODER_ONLY))
    _refuses(r"a loss computed by its own forward.*positions taken from each call's token index", patch, model, cp)
    assert not is_patched(model)
    with pytest.raises(UnsupportedFeatureError, match="positions taken from each call's token index"):
        longdoc.hf.generate(model, cp, _ids(8), 2)
