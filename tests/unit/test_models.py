"""longdoc.models: tiny configs, GGUF conversion, the real default model, and load errors."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from longdoc import models

SENTENCE = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital of Germany."
)


# ---------------------------------------------------------------------------------------------
# tiny models


def _ids(vocab: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", models.TINY_ARCHS)
def test_tiny_model_forward_is_deterministic_per_seed(arch):
    a, b, c = (models.tiny_model(arch, seed=s) for s in (0, 0, 1))
    assert a.config._attn_implementation == "sdpa"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)

    ids = _ids(a.config.vocab_size)
    a.train()  # no dropout anywhere, so even train mode repeats exactly
    out1, out2 = a(ids, labels=ids), a(ids, labels=ids)
    assert out1.logits.shape == (2, 24, 256)
    assert torch.isfinite(out1.loss) and torch.equal(out1.logits, out2.logits)
    out1.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", models.TINY_ARCHS)
def test_tiny_config_is_small_causal_and_dropout_free(arch):
    cfg = models.tiny_config(arch)
    assert cfg.model_type == arch
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert (cfg.num_key_value_heads, cfg.vocab_size, cfg.max_position_embeddings) == (2, 256, 131072)
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == 16
    # qwen2_moe's config turns an unused window into 0 (not None) whatever we pass.
    assert not getattr(cfg, "sliding_window", None)
    assert set(getattr(cfg, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    for key, value in vars(cfg).items():
        if key.endswith(("dropout", "pdrop")) and isinstance(value, float):
            assert value == 0.0, key
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, key, None)
        assert value is None or 0 <= value < 256, (key, value)


def test_tiny_archs_cover_partial_rotary_and_moe():
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"):
        assert arch in models.TINY_ARCHS
    assert models.tiny_config("stablelm").rope_parameters["partial_rotary_factor"] < 1
    assert models.tiny_config("qwen2_moe").num_experts > 1
    assert models.tiny_config("mixtral").num_local_experts > 1


def test_tiny_overrides_win():
    cfg = models.tiny_config("mistral", sliding_window=16, num_hidden_layers=3, attention_dropout=0.1)
    assert (cfg.sliding_window, cfg.num_hidden_layers, cfg.attention_dropout) == (16, 3, 0.1)


def test_tiny_model_leaves_caller_rng_alone_and_casts_exactly():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fp32 = models.tiny_model("llama", seed=5)
    assert torch.equal(torch.rand(3), expected)
    bf16 = models.tiny_model("llama", seed=5, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    sd = fp32.state_dict()
    assert all(torch.equal(v, sd[k].to(torch.bfloat16)) for k, v in bf16.state_dict().items())


def test_unknown_arch_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt7'.*llama.*mixtral"):
        models.tiny_config("gpt7")
    with pytest.raises(ValueError, match="unknown tiny architecture 'gpt7' in 'tiny:gpt7'"):
        models.load_config("tiny:gpt7")


# ---------------------------------------------------------------------------------------------
# atomic build


def test_the_tiny_names_load_without_transformers():
    """--help lists the tiny names from longdoc.models.zoo: the package imports its loaders on first use only."""
    import subprocess
    import sys

    code = ("import sys, longdoc.models.zoo as z; from longdoc.models import zoo; "
            "assert z.NAMES and 'transformers' not in sys.modules, 'transformers imported'")
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})


def _writer(content: str, calls: list[str] | None = None, delay: float = 0.0):
    def build(tmp: Path) -> None:
        if calls is not None:
            calls.append(str(tmp))
        time.sleep(delay)
        (tmp / "weights.txt").write_text(content)

    return build


def test_atomic_build_builds_once_and_leaves_no_temp(tmp_path):
    calls: list[str] = []
    target = tmp_path / "m"
    assert models.atomic_build(target, _writer("a", calls)) == target
    assert models.atomic_build(target, _writer("b", calls)) == target
    assert len(calls) == 1 and (target / "weights.txt").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_atomic_build_failure_leaves_nothing_usable(tmp_path):
    target = tmp_path / "m"

    def crash(tmp: Path) -> None:
        (tmp / "half.safetensors").write_text("x")
        raise KeyboardInterrupt  # a crash mid-conversion

    with pytest.raises(KeyboardInterrupt):
        models.atomic_build(target, crash)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]
    assert (models.atomic_build(target, _writer("ok")) / "weights.txt").read_text() == "ok"


def test_atomic_build_ignores_stale_temp_and_sweeps_old_ones(tmp_path):
    target = tmp_path / "m"
    fresh, old = tmp_path / ".m.tmp-fresh", tmp_path / ".m.tmp-old"
    for tmp in (fresh, old):  # complete-looking leftovers of crashed builds
        tmp.mkdir()
        (tmp / "weights.txt").write_text("stale")
        (tmp / "longdoc-conversion.json").write_text("{}")
    long_ago = time.time() - 2 * 86400
    os.utime(old, (long_ago, long_ago))
    assert (models.atomic_build(target, _writer("new")) / "weights.txt").read_text() == "new"
    assert fresh.exists() and not old.exists()  # a fresh one may belong to a live process elsewhere


def test_atomic_build_lost_rename_race_uses_the_winner(tmp_path):
    target = tmp_path / "m"

    def build_while_other_wins(tmp: Path) -> None:
        # Another process (no working lock on this filesystem) finishes first.
        other = tmp_path / ".m.tmp-other"
        other.mkdir()
        (other / "weights.txt").write_text("theirs")
        (other / "longdoc-conversion.json").write_text("{}")
        os.rename(other, target)
        (tmp / "weights.txt").write_text("ours")

    assert (models.atomic_build(target, build_while_other_wins) / "weights.txt").read_text() == "theirs"
    assert not list(tmp_path.glob(".m.tmp-*"))


def test_atomic_build_refuses_an_incomplete_target(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "model.safetensors").write_text("half")
    with pytest.raises(RuntimeError, match="not a complete longdoc conversion; delete it"):
        models.atomic_build(target, _writer("x"))


def test_atomic_build_concurrent_callers_build_once(tmp_path):
    calls: list[str] = []
    target = tmp_path / "m"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(models.atomic_build(target, _writer("a", calls, 0.3))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3 and len(calls) == 1


# ---------------------------------------------------------------------------------------------
# names, folders, errors


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGDOC_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LONGDOC_CACHE")
    assert models.default_cache_dir() == tmp_path / "x" / "longdoc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert models.default_cache_dir() == tmp_path / "h" / ".cache" / "longdoc"


def test_hub_id_offline_says_what_to_use_instead(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(OSError, match=r"HF_HUB_OFFLINE=1.*offline default 'SmolLM2-135M-Instruct'.*local folder"):
        models.load_config("longdoc-test-org/no-such-model")
    assert time.monotonic() - start < 10


def test_missing_local_path_is_not_sent_to_the_hub():
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        models.resolve("./no/such/checkpoint")
    assert models.resolve("org/model") == "org/model"


def test_pickle_only_folder_is_refused(tmp_path):
    models.tiny_config("llama").save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle weights.*save_pretrained"):
        models.load(str(tmp_path))


def test_config_json_path(tmp_path):
    models.tiny_config("qwen3", num_hidden_layers=3).save_pretrained(tmp_path)
    cfg = models.load_config(str(tmp_path / "config.json"))
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.head_dim) == ("qwen3", 3, 16)
    assert models.load_config(str(tmp_path)).num_hidden_layers == 3


# ---------------------------------------------------------------------------------------------
# the real default model (converted once into the default cache, shared by the whole suite)


def test_default_model_loads_converted_with_chat_template():
    start = time.monotonic()
    model, tok = models.load()
    elapsed = time.monotonic() - start
    cfg = model.config
    assert cfg.model_type == "llama" and not hasattr(cfg, "quantization_config")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings) == (576, 49152, 8192)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg.rope_parameters["rope_theta"] == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert model.dtype == torch.float32 and model.config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None

    assert len(tok) == 49152 and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    ids = tok(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model.eval()(ids, labels=ids).loss.item()
    assert 0.5 < loss < 5.0, loss  # measured 2.66 nats/token
    # Conversion (first use on a machine) takes ~20-30 s; loading the converted folder well under 5 s.
    print(f"load(): {elapsed:.1f} s, loss {loss:.3f}")

    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == models.resolve(models.DEFAULT_MODEL)


def test_tiny_with_default_tokenizer():
    model, tok = models.load("tiny:qwen2", seed=3)
    assert model.config.vocab_size == len(tok) == 49152
    ids = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # load_config("tiny:...") uses these constants without loading the tokenizer.
    assert models.DEFAULT_TOKEN_IDS == {"vocab_size": len(tok), **ids}
    assert all(getattr(model.config, k) == v for k, v in ids.items())
    assert models.load_config("tiny:qwen2").vocab_size == 49152
    assert models.load_tokenizer("tiny:qwen2").chat_template == tok.chat_template
    ids = tok(SENTENCE, return_tensors="pt").input_ids
    assert torch.isfinite(model(ids, labels=ids).loss)


def test_local_folder_round_trip(tmp_path):
    model = models.tiny_model("gemma", seed=2, vocab_size=49152)
    model.save_pretrained(tmp_path)
    models.load_tokenizer().save_pretrained(tmp_path)
    loaded, tok = models.load(str(tmp_path))
    ids = tok(SENTENCE, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded.eval()(ids).logits)


@pytest.mark.slow
def test_gguf_conversion_into_fresh_cache_matches_direct_gguf_load(tmp_path):
    from transformers import AutoModelForCausalLM, GgufConfig

    start = time.monotonic()
    folder = Path(models.resolve(models.DEFAULT_MODEL, cache_dir=str(tmp_path)))
    convert_s = time.monotonic() - start
    assert folder.parent == tmp_path / "models" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert not list(folder.parent.glob(".*.tmp-*"))
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "longdoc-conversion.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config

    start = time.monotonic()
    assert models.resolve(models.DEFAULT_MODEL, cache_dir=str(tmp_path)) == str(folder)
    model, _ = models.load(cache_dir=str(tmp_path))
    load_s = time.monotonic() - start
    print(f"conversion {convert_s:.1f} s, load from cache {load_s:.1f} s")

    gguf = models._default_gguf()
    # The fallback used when a GGUF tokenizer comes without a template reads the same metadata.
    assert models.gguf.read_gguf_field(gguf, "tokenizer.chat_template") == models.load_tokenizer().chat_template
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    ours = model.state_dict()
    assert all(torch.equal(t, ours[k]) for k, t in direct.state_dict().items())
