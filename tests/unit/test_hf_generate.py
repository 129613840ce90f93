"""longdoc.hf.generate, the token Sampler, patched model.generate and the batch checksum, in one process."""

from __future__ import annotations

import pickle

import pytest
import torch

import longdoc
from longdoc import models
from longdoc.hf import CPInputError, generate, is_patched, patch, unpatch
from longdoc.hf.decode import Sampler
from longdoc.hf.session import KVSession
from longdoc.parallel.batch import checksum


@pytest.fixture
def cp():
    return longdoc.ContextParallel()


def _ids(length=30, bsz=1, seed=0):
    return torch.randint(3, 256, (bsz, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_generate_equals_transformers_and_leaves_the_model_alone(cp):
    model = models.tiny_model("qwen3", seed=2).eval()
    ids = _ids(33, bsz=2)
    ref = model.generate(ids, max_new_tokens=7, do_sample=False)
    got = generate(model, cp, ids, 7)
    assert torch.equal(got.tokens, ref[:, 33:])
    assert model.config._attn_implementation == "sdpa" and not is_patched(model)
    assert not any("_longdoc_cp" in m.__dict__ for m in model.modules())


def test_generate_stops_at_the_generation_configs_eos_like_model_generate(cp):
    """No eos_token_id passed: both read the model's generation_config, stop there, and pad the finished row."""
    model = models.tiny_model("llama", seed=5).eval()
    ids = _ids(21, bsz=2, seed=3)
    free = generate(model, cp, ids, 12, eos_token_id=[]).tokens  # [] = no EOS: decode all 12
    assert free.shape == (2, 12)
    # an EOS that row 0 reaches at step 3 and row 1 later or never; a pad id distinct from it
    eos = int(free[0, 3])
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, (eos + 1) % 256
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)[:, 21:]
    got = generate(model, cp, ids, 12).tokens
    assert torch.equal(got, ref), (got, ref)
    assert int(got[0, 3]) == eos and bool((got[0, 4:] == (eos + 1) % 256).all())
    patched = patch(models.tiny_model("llama", seed=5).eval(), cp)
    patched.generation_config.eos_token_id, patched.generation_config.pad_token_id = eos, (eos + 1) % 256
    assert torch.equal(patched.generate(ids, max_new_tokens=12)[:, 21:], ref)


def test_a_session_on_an_unpatched_model_does_not_count_as_patched(cp):
    model = models.tiny_model("llama").eval()
    with KVSession(model, cp) as session:
        assert not is_patched(model) and model.config._attn_implementation == "longdoc_cp"
        session.prefill(_ids(9))
    assert model.config._attn_implementation == "sdpa"


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(cp):
    model = models.tiny_model("llama", seed=3).eval()
    ids = _ids(25)
    runs = [generate(model, cp, ids, 10, do_sample=True, temperature=1.5, seed=s).tokens for s in (0, 0, 1)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    greedy = generate(model, cp, ids, 10).tokens
    assert torch.equal(generate(model, cp, ids, 10, do_sample=True, top_k=1, seed=4).tokens, greedy)
    assert torch.equal(generate(model, cp, ids, 10, do_sample=True, top_p=1e-9, seed=4).tokens, greedy)


def test_sampler_draws_by_the_filtered_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.05, 0.25]])).expand(4000, -1)
    counts = torch.bincount(Sampler(do_sample=True).choose(logits, g), minlength=4) / 4000
    assert (counts - torch.tensor([0.1, 0.6, 0.05, 0.25])).abs().max() < 0.03
    top2 = torch.bincount(Sampler(do_sample=True, top_k=2).choose(logits, g), minlength=4) / 4000
    assert top2[0] == top2[2] == 0 and abs(top2[1] - 0.6 / 0.85) < 0.03
    # top_p=0.8: 0.6 alone is not enough, 0.6 + 0.25 is -> tokens 1 and 3 only
    nucleus = torch.bincount(Sampler(do_sample=True, top_p=0.8).choose(logits, g), minlength=4) / 4000
    assert nucleus[0] == nucleus[2] == 0 and abs(nucleus[3] - 0.25 / 0.85) < 0.03
    cold = torch.bincount(Sampler(do_sample=True, temperature=0.05).choose(logits, g), minlength=4)
    assert cold[1] == 4000


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be None or an integer >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(strategy="rign"), "strategy must be one of 'ring', 'allgather'"),
])
def test_bad_decoding_arguments_are_refused_by_name(cp, kwargs, match):
    call = dict(max_new_tokens=3, do_sample=True, **kwargs) if "max_new_tokens" not in kwargs else \
        dict(do_sample=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        generate(models.tiny_model("llama").eval(), cp, _ids(5), **call)


def test_patched_model_generate_routes_through_the_session(cp):
    model = models.tiny_model("llama", seed=5).eval()
    ids = _ids(21)
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    patch(model, cp)
    assert torch.equal(model.generate(ids, max_new_tokens=6), ref)
    assert torch.equal(model.generate(**{"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                      max_new_tokens=6), ref)
    assert is_patched(model) and model.config._attn_implementation == "longdoc_cp"
    # an EOS ends the row like transformers: pad_token_id after it
    eos = int(ref[0, 23])
    out = model.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    want = model.__class__.generate(unpatch(model), ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, want)
    assert "generate" not in model.__dict__  # unpatch removed the routing


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=2), "the argument\\(s\\) num_beams"),
    (dict(attention_mask=torch.tensor([[1] * 18 + [0] * 3])), "an attention_mask that is not left padding"),
    (dict(input_ids=None), "no \\(batch, len\\) integer input_ids"),
])
def test_patched_model_generate_names_the_call_that_works(cp, kwargs, match):
    model = patch(models.tiny_model("llama").eval(), cp)
    call = {"input_ids": _ids(21), "max_new_tokens": 4, **kwargs}
    with pytest.raises(CPInputError, match=match) as info:
        model.generate(**call)
    assert "longdoc.hf.generate(model, cp, input_ids, max_new_tokens" in str(info.value)


def test_unpickled_patched_model_refuses_to_generate(cp):
    revived = pickle.loads(pickle.dumps(patch(models.tiny_model("llama").eval(), cp)))
    with pytest.raises(RuntimeError, match="call longdoc.patch"):
        revived.generate(_ids(8), max_new_tokens=2)


def test_checksum_sees_every_change():
    x = torch.randint(0, 50_000, (2, 4096))
    base = checksum(x)
    y = x.clone()
    y[1, 4095] += 1
    swapped = x.clone()
    swapped[0, [10, 11]] = x[0, [11, 10]]
    rows = x.flip(0)
    assert len({base, checksum(y), checksum(swapped), checksum(rows)}) == 4
    assert checksum(x.clone()) == base
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))
    for t in (torch.ones(3, dtype=torch.bool), torch.randn(2, 3, 5).bfloat16(), torch.randn(4).double()):
        assert checksum(t) == checksum(t.clone())


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss", "gemma2"])
def test_decoding_honours_windows_sinks_and_softcap(cp, arch):
    """Prompt + new tokens cross the 7-token window: every decoded token sees only its window on the
    sliding layers (sinks / soft-capping apply), exactly as transformers' own cached decoding."""
    from tests.support.hf_families import family_pair

    ref, model = family_pair(arch, dtype=torch.float64)
    ids = _ids(12)
    want = ref.generate(ids, max_new_tokens=9, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got = generate(model, cp, ids, 9, return_logits=True)
    assert torch.equal(got.tokens, want.sequences[:, 12:])
    assert (got.logits - torch.stack(want.logits, dim=1).float()).abs().max() <= 1e-5
    # and through a rollback: the cached positions go back with the cache
    with KVSession(model, cp) as session:
        logits = session.prefill(ids)
        mark = session.mark()
        session.extend(_ids(5, seed=3))
        session.rollback(mark)
        again = session.greedy(logits, 9)
    assert torch.equal(again.tokens, got.tokens)


def test_left_padded_prompts_generate_like_transformers(cp):
    """model.generate with left-padded prompts of unequal length (padding_side='left'): each prompt decodes
    as transformers decodes it in the padded batch (pads see nothing, positions count from the first token)."""
    ref, model = models.tiny_model("llama", seed=4).eval(), models.tiny_model("llama", seed=4).eval()
    ids = _ids(14, bsz=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    patch(model, cp)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8), want)


def test_left_padded_prompts_with_a_window_decode_as_alone(cp):
    # (transformers' own eager Gemma 3 turns a left-padded row into NaN, so each prompt alone is the reference)
    from tests.support.hf_families import family_pair

    ref, model = family_pair("gemma3_text", dtype=torch.float64)
    ids = _ids(14, bsz=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    got = generate(model, cp, ids, 9, attention_mask=mask).tokens
    for r, n in enumerate((0, 5)):
        alone = ref.generate(ids[r:r + 1, n:], max_new_tokens=9, do_sample=False, eos_token_id=None)
        assert torch.equal(got[r:r + 1], alone[:, 14 - n:])
