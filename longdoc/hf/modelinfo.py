"""What longdoc needs to know about a transformers model before patching it: the PreTrainedModel inside a
wrapper, its name for errors, its layer count, the config features the CP core cannot reproduce (refused
by name) and the RoPE scalings whose result depends on the largest position a rank sees."""

from __future__ import annotations

import torch

from longdoc.errors import UserError

# Layer kinds whose attention the CP core computes (full causal, sliding window, Llama 4 chunks); the MLP
# kinds carry no attention at all. Anything else (linear attention, SSM, convolutions) is refused by name.
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "dense", "sparse", "moe"}


class UnsupportedFeatureError(UserError, NotImplementedError):
    """A model feature the context-parallel path cannot reproduce exactly."""


def refuse(model_name: str, feature: str, fix: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"longdoc.patch: {model_name} uses {feature}, which context-parallel attention cannot reproduce "
        f"exactly; {fix}"
    )


# ---- the model and its config ----

def hf_model(model: torch.nn.Module):
    """The transformers PreTrainedModel in `model` (itself, or the one inside e.g. a PEFT wrapper)."""
    from transformers import PreTrainedModel

    for m in model.modules():  # the model itself first, then e.g. the model inside a PEFT wrapper
        if isinstance(m, PreTrainedModel):
            return m
    raise TypeError(f"longdoc.patch needs a transformers PreTrainedModel (or a wrapper holding one), "
                    f"got {type(model).__name__}")


def model_name(hf) -> str:
    """How errors name a model: its class and, when known, where it was loaded from."""
    path = getattr(hf.config, "_name_or_path", "") or ""
    return f"{type(hf).__name__} ({path})" if path else type(hf).__name__


def num_layers(config) -> int:
    return int(getattr(config.get_text_config(), "num_hidden_layers", 1) or 1)


def _configs(config) -> list:
    out = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        out.append(text)
    return out


def check_config(config, name: str, covered: frozenset[str] = frozenset()) -> None:
    """Refuse, by name, config features that make attention differ from what the CP core computes.
    covered: the layer types the model's layer kinds (longdoc.hf.kinds) compute besides attention."""
    for c in _configs(config):
        if not getattr(c, "is_causal", True) or getattr(c, "use_bidirectional_attention", False):
            raise refuse(name, "non-causal (bidirectional) attention",
                         "context parallelism here covers causal language models only")
        if (getattr(c, "alibi", False) or getattr(c, "position_embedding_type", None) == "alibi"
                or getattr(c, "model_type", None) in ("bloom", "mpt")):
            raise refuse(name, "ALiBi position biases", "use a RoPE or absolute-position model")
        types = list(getattr(c, "layer_types", None) or ())
        kinds = sorted(set(types) - _SUPPORTED_LAYER_TYPES - covered)
        if kinds:
            raise refuse(name, f"layers of type {', '.join(map(repr, kinds))} (linear attention, state-space or "
                         f"convolution layers have no attention pattern the CP core computes)",
                         "only full, sliding-window and chunked causal attention layers are supported")
        if "chunked_attention" in types and not positive_int(getattr(c, "attention_chunk_size", None)):
            raise refuse(name, f"chunked attention layers without a valid attention_chunk_size "
                         f"({getattr(c, 'attention_chunk_size', None)!r})", "set config.attention_chunk_size")


def own_loss_problem(hf) -> tuple[str, str] | None:
    """(feature, fix) for a model whose forward takes labels but computes its loss itself instead of through
    model.loss_function (which patch replaces by the CP share): the ForCausalLM decoders of the encoder-decoder
    families (BART, mBART, Pegasus, Blenderbot, Marian, PLBart, MVP, TrOCR, Whisper, ProphetNet, ...), CPM-Ant,
    MusicGen, XLM, XLNet. Most of them also take no position_ids, so they would number each rank's tokens from 0."""
    import inspect

    forward = type(hf).forward
    try:
        source = inspect.getsource(forward)
        params = inspect.signature(forward).parameters
    except (OSError, TypeError, ValueError):
        return None
    if "labels" not in params or "loss_function" in source:
        return None
    feature = "a loss computed by its own forward, not through model.loss_function (the CP loss share replaces that)"
    if "position_ids" not in params:
        feature += ", and positions taken from each call's token index (it accepts no position_ids)"
    return feature, "run this model without CP"


def positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def rope_limit(config) -> tuple[str, int] | None:
    """(rope_type, length limit) for RoPE scalings that pick frequencies from the largest position id in
    the call: under CP each rank sees different positions, so they agree only below the limit."""
    for c in _configs(config):
        params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        per_layer = [p for p in params.values() if isinstance(p, dict)] or [params]
        for p in per_layer:
            kind = p.get("rope_type", p.get("type")) or "default"
            if "dynamic" in kind:
                return kind, int(c.max_position_embeddings)
            if kind == "longrope":
                return kind, int(p.get("original_max_position_embeddings")
                                 or getattr(c, "original_max_position_embeddings", c.max_position_embeddings))
    return None
