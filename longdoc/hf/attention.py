"""The attention and mask functions longdoc registers with transformers under the name "longdoc_cp".

transformers looks attention functions up by `config._attn_implementation`, so one registered name
serves every patched model; the ContextParallel object itself lives on each patched model's modules
(`module._longdoc_cp`, a `CPHandle`), never in a module global, so models patched with different
groups in one process do not interfere.

The mask function builds nothing: under CP the only pattern the ring computes is plain causal
attention over the global sequence, and right padding needs no mask for the tokens that count
(a real token never sees a pad after it). Everything else that would change the attention result is
refused here, at call time, with an error that names the feature and the model.
"""

from __future__ import annotations

import torch

import longdoc
from longdoc.parallel.api import ContextParallel

NAME = "longdoc_cp"

# Keyword arguments some transformers models pass to their attention function that change the
# result in ways the ring does not compute: name -> the feature, for the error message.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "position_bias": "an additive position bias (ALiBi / relative position bias)",
    "alibi": "ALiBi position bias",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "cu_seq_lens_q": "packed variable-length sequences (cu_seq_lens)",
    "cu_seq_lens_k": "packed variable-length sequences (cu_seq_lens)",
    "cu_seqlens": "packed variable-length sequences (cu_seqlens)",
}


class CPHandle:
    """What a patched model carries on each of its modules: the CP group, the strategy, counters.

    Deep copies of a patched model share the handle (a ProcessGroup cannot be copied); a pickled
    model comes back unpatched-but-marked, and refuses to run until patched again.
    """

    def __init__(self, cp: ContextParallel | None, strategy: str, model_name: str, config=None):
        self.cp, self.strategy, self.model_name, self.config = cp, strategy, model_name, config
        self.attention_calls = 0  # in the current forward, checked by the post-hook
        self.loss_calls = 0
        self.restore: tuple | None = None  # (attn implementation, had own loss_function, that loss_function)

    def __deepcopy__(self, memo) -> CPHandle:
        return self

    def __reduce__(self):
        return (CPHandle, (None, self.strategy, self.model_name))

    def __repr__(self) -> str:
        return f"CPHandle({self.cp!r}, strategy={self.strategy!r}, model={self.model_name!r})"


class UnsupportedFeatureError(NotImplementedError):
    """A model feature the context-parallel path cannot reproduce exactly."""


def refuse(model_name: str, feature: str, fix: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"longdoc.patch: {model_name} uses {feature}, which context-parallel attention cannot reproduce "
        f"exactly; {fix}"
    )


def handle_of(module: torch.nn.Module) -> CPHandle:
    handle = getattr(module, "_longdoc_cp", None)
    if handle is None or handle.cp is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={NAME!r} but its model is not patched "
            f"(or was unpickled/unpatched); call longdoc.patch(model, cp) on the model first"
        )
    return handle


def _call_problem(module, query, key, attention_mask, dropout, is_causal, kwargs) -> tuple[str, str] | None:
    """(feature, fix) when this attention call asks for something the ring does not compute."""
    if attention_mask is not None:
        shape = tuple(getattr(attention_mask, "shape", ()))
        return (f"a custom {len(shape)}-D attention mask {shape}",
                "pass a 2-D right-padding attention_mask (or none) and let cp.shard_batch build the batch; "
                "packed or block-diagonal masks are not supported under CP")
    if key.shape[2] != query.shape[2]:
        return (f"attention over a KV cache or other keys ({key.shape[2]} keys for {query.shape[2]} queries)",
                "call the model with use_cache=False and no past cache; for evaluation use "
                "longdoc.hf.prefill, which runs the whole prompt at once")
    if dropout:
        return (f"attention dropout in training mode (p={dropout})",
                "set config.attention_dropout = 0 (and reload/re-init the attention modules if they read "
                "it at construction), or call model.eval() for evaluation")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        return ("non-causal (bidirectional) attention",
                "context parallelism here covers causal language models only")
    for name, feature in _UNSUPPORTED_KWARGS.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            return f"{feature} ({name}={value if not torch.is_tensor(value) else 'tensor'})", \
                "run this model without CP, or switch the feature off in its config"
    if kwargs.get("output_attentions"):
        return ("output_attentions=True", "attention weights are never materialized under CP; "
                "call the model without output_attentions")
    return None


def _window_problem(window, global_len: int, cp: ContextParallel) -> tuple[str, str] | None:
    if window is None:
        return None
    if not isinstance(window, int):
        return f"a sliding window of unsupported form ({window!r})", "use full causal attention"
    # HF's sliding overlay lets query i see key j when i - j < window: that is plain causal attention
    # exactly when the whole (padded) sequence fits in the window.
    if global_len > window:
        return (f"sliding-window attention (window {window} < sequence length {global_len}, the length "
                f"padded to a multiple of cp.multiple={cp.multiple})",
                f"use sequences of at most {window} tokens (padded), or a model without sliding-window layers")
    return None


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: (batch, heads, local_len, head_dim) shards -> (batch, local_len, heads,
    head_dim) shard of the full-sequence causal attention, like `sdpa_attention_forward`."""
    handle = handle_of(module)
    cp = handle.cp
    problem = _call_problem(module, query, key, attention_mask, dropout, is_causal, kwargs)
    if problem is None:
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        problem = _window_problem(window, query.shape[2] * cp.size, cp)
    if problem is not None:
        raise refuse(handle.model_name, *problem)

    if torch.is_autocast_enabled(query.device.type):
        # Under autocast SDPA (which this replaces) runs in the autocast dtype; RoPE leaves q and k in fp32
        # while v comes out of its projection in bf16.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    head_dim = query.shape[-1]
    if scaling is None:
        scaling = head_dim ** -0.5  # before any zero-padding of the head dims below
    v_dim = value.shape[-1]
    if v_dim < key.shape[-1]:
        # Zero columns of V give zero output columns and leave the softmax alone: exact, sliced off below.
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))
    elif v_dim > key.shape[-1]:
        # Zero columns of Q and K add nothing to the scores.
        pad = v_dim - key.shape[-1]
        query = torch.nn.functional.pad(query, (0, pad))
        key = torch.nn.functional.pad(key, (0, pad))
    out = longdoc.attention(query, key, value, cp, causal=True, scale=scaling, strategy=handle.strategy)
    handle.attention_calls += 1
    # (batch, q_heads, local_len, head_dim) -> (batch, local_len, q_heads, v_dim), what HF modules expect
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


def cp_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs) -> None:
    """Mask function for AttentionMaskInterface: never builds a mask (no (L x L) tensor per rank).

    The 2-D padding mask, if any, was checked to be right padding by the patched model's forward
    pre-hook; 4-D masks never reach this function (transformers passes them through unchanged and
    `cp_attention_forward` refuses them)."""
    return None


def register() -> None:
    """Register NAME with transformers' attention and mask interfaces, never replacing another function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for interface, fn in ((AttentionInterface, cp_attention_forward), (AttentionMaskInterface, cp_mask)):
        existing = interface._global_mapping.get(NAME)
        if existing is not None and getattr(existing, "__module__", None) != __name__:
            raise RuntimeError(
                f"{interface.__name__} already has a function named {NAME!r} from {existing.__module__}; "
                f"longdoc never overwrites a registered attention implementation"
            )
        if existing is not fn:
            interface.register(NAME, fn)
