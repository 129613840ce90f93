"""The masks a patched model means (longdoc.hf.mask_probe) and the layers whose attention call does not carry them;
LayerDrop refused in training mode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import masking_utils as mu

import longdoc
from longdoc.hf import UnsupportedFeatureError
from longdoc.hf import mask_probe as probe

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)


@pytest.mark.parametrize("window", [1, 7, 4096, 131072])
def test_transformers_windows_are_read_as_windows(window):
    assert probe.shape_of(mu.sliding_window_causal_mask_function(window)) == window


def test_causal_and_the_shapes_it_cannot_name():
    assert probe.shape_of(mu.causal_mask_function) == probe.CAUSAL
    assert probe.shape_of(mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))) is None
    assert probe.shape_of(mu.bidirectional_mask_function) is None
    padding = mu.padding_mask_function(torch.ones(1, 20, dtype=torch.bool))
    assert probe.shape_of(mu.and_masks(mu.causal_mask_function, padding)) is None  # reads a tensor
    assert probe.shape_of(lambda b, h, q, kv: kv <= q - 1) is None  # the query's own key hidden
    assert probe.shape_of(None) is None


def test_transformers_packed_wrapping_leaves_the_pattern_readable():
    # a call without cache whose position_ids jump (a zigzag rank's own) is wrapped as packed sequences: read as
    # "unknown" on that rank only, a window only the mask carries was refused on the other ranks alone (a hang)
    positions = torch.tensor([[0, 1, 2, 3, 4, 30, 31, 32, 33, 34]])
    packed = mu.find_packed_sequence_indices(positions)
    assert packed is not None
    for pattern, shape in ((mu.sliding_window_causal_mask_function(7), 7), (mu.causal_mask_function, probe.CAUSAL)):
        wrapped = mu.and_masks(mu.remap_positions_for_packed_sequence(pattern, positions),
                               mu.packed_sequence_mask_function(packed))
        assert probe.shape_of(wrapped) == shape
    padding = mu.padding_mask_function(torch.ones(1, 20, dtype=torch.bool))
    assert probe.shape_of(mu.and_masks(mu.causal_mask_function, padding)) is None  # other pairs stay unknown


def test_mismatch_only_where_the_masks_are_known_and_the_layer_is_none_of_them():
    class H:
        masks_seen = None

    h = H()
    assert probe.mismatch(h, None, False, 100) is None  # no forward recorded
    h.masks_seen = [probe.CAUSAL, 7]
    assert probe.mismatch(h, 7, False, 100) is None and probe.mismatch(h, None, False, 100) is None
    assert probe.mismatch(h, 9, False, 100) is not None
    h.masks_seen = [7]
    what, fix = probe.mismatch(h, None, False, 100)
    assert "sliding-window (7 tokens)" in what and "full causal" in what and "sliding_window" in fix
    assert probe.mismatch(h, None, False, 7) is None  # a window covering the row hides nothing
    assert probe.mismatch(h, None, True, 100) is None  # chunked layers: the probe does not name chunks
    h.masks_seen = [7, None]
    assert probe.mismatch(h, None, False, 100) is None  # one unknown mask: no judgement


def _tiny(model_type: str, **over):
    config = AutoConfig.for_model(model_type, **TINY, **over)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _forward(model, cp, length=20):
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    return model(**cp.shard_batch({"input_ids": ids, "labels": ids}))


def test_a_window_only_the_mask_carries_is_refused_by_name():
    # transformers' PhiMoE builds a sliding-window mask but passes no window to its attention function
    cp = longdoc.ContextParallel()
    model = longdoc.patch(_tiny("phimoe", sliding_window=7, num_local_experts=4), cp).eval()
    with pytest.raises(UnsupportedFeatureError, match=r"sliding-window \(7 tokens\) masks that its attention"):
        _forward(model, cp)
    covering = longdoc.patch(_tiny("phimoe", sliding_window=64, num_local_experts=4), cp).eval()
    ref = _tiny("phimoe", sliding_window=64, num_local_experts=4).eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_forward(covering, cp).logits, ref(input_ids=ids).logits)


def test_mistral_window_is_carried_and_exact():
    cp = longdoc.ContextParallel()
    model = longdoc.patch(_tiny("mistral", sliding_window=5), cp)
    ref = _tiny("mistral", sliding_window=5)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_forward(model, cp).logits, ref(input_ids=ids).logits)
    assert model._longdoc_cp.masks_seen == [5]


def test_layerdrop_in_training_mode_is_refused_and_eval_runs():
    cp = longdoc.ContextParallel()
    config = AutoConfig.for_model("opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=256, word_embed_proj_dim=64, layerdrop=0.5)
    model = longdoc.patch(AutoModelForCausalLM.from_config(config, attn_implementation="eager"), cp).train()
    with pytest.raises(UnsupportedFeatureError, match=r"LayerDrop in training mode \(config.layerdrop = 0.5\)"):
        _forward(model, cp)
    assert _forward(model.eval(), cp).logits.shape == (1, 20, 256)
