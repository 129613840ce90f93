"""The transformers backend "longdoc_cp": the ONE module that touches transformers' attention registry.

transformers looks attention functions up by `config._attn_implementation`, so one registered name
serves every patched model and every KV session; the ContextParallel object itself lives on each
model's modules (`module._longdoc_cp`, a `CPHandle`), never in a module global, so models patched with
different groups in one process do not interfere.

One attention function, one per-call checker, dispatched by the handle's mode:
  "train"            a patched model's forward (training, evaluation prefill): exact CP attention
                     over the sharded sequence (`longdoc.parallel.api.attention`);
  "prefill"/"extend" inside a `KVSession` (longdoc.hf.session): the prompt's CP prefill, then new
                     tokens over every rank's cache shard (`longdoc.hf.decode.extend_attention`), or
  "branch"           several rows continuing one prompt (`longdoc.hf.branches.branch_attention`).
Every layer's attention pattern goes to the CP core, read per call (`layer_pattern`): its sliding window (the
`sliding_window` argument or the module's attribute), Llama 4's chunked attention (the layer's type in
config.layer_types and config.attention_chunk_size: the call carries no chunk argument), logit soft-capping
(`softcap`), attention sinks (`s_aux` / `sinks`), and, for packed rows, the documents the forward pre-hook read from
the call's `cu_seq_lens_q` (cp.shard_batch makes them) with their preference pairs (sibling branches:
longdoc.hf.pairs), and sparse indexed attention's selected keys (`indices=`, the DSA indexer's global top-k: see
longdoc.hf.kinds.dsa). The mask function builds nothing: those patterns are computed in global positions by
the core, and right padding needs no mask for the tokens that count (cp.shard_batch turns left padding into
right padding); models with indexed attention layers, whose code slices the mask for their indexer, get an
all-visible placeholder of zero size in memory instead of None (`no_mask`). Everything else that would change
the result is refused at call time, naming the feature.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from longdoc.hf import branches, decode, mask_probe, pairs, query_temperature
from longdoc.hf.modelinfo import model_name, positive_int, refuse
from longdoc.parallel.api import ContextParallel, attention
from longdoc.parallel.batch import documents_of

NAME = "longdoc_cp"

# Keyword arguments some transformers models pass to their attention function that change the
# result in ways CP does not compute: name -> the feature, for the error message.
_UNSUPPORTED_KWARGS = {
    "position_bias": "an additive position bias (ALiBi / relative position bias)",
    "alibi": "ALiBi position bias",
    "cu_seqlens": "packed variable-length sequences given as cu_seqlens (pass position_ids restarting at 0 "
                  "per document to cp.shard_batch instead)",
}


@dataclass
class Session:
    """What a KVSession puts on its model's handle while it runs (the handle's mode comes from here)."""

    cp: ContextParallel
    strategy: str
    mode: str = "idle"  # "prefill" | "extend" once the session has made a call
    appending: bool = True  # this rank stores the new tokens of the current extend call
    total: int = 0  # global length after the current call
    # global positions of the tokens this rank has cached before the current extend call: the window and
    # chunk masks of decoded tokens are functions of global positions
    key_positions: torch.Tensor | None = None
    # the same for every rank of the group (identical on all ranks): where each rank's cached DSA index keys go
    rank_positions: list[torch.Tensor] | None = None
    branch: branches.BranchState | None = None  # while several rows continue the prompt (longdoc.hf.branches)


class CPHandle:
    """What a model carries on each of its modules: the CP group, the strategy, the mode, counters.

    Deep copies of a patched model share the handle (a ProcessGroup cannot be copied); a pickled
    model comes back unpatched-but-marked, and refuses to run until patched again. `patched` is False
    for the temporary handle a KVSession puts on a model that was not patched.
    """

    def __init__(self, cp: ContextParallel | None, strategy: str, model_name: str, config=None,
                 patched: bool = True):
        self.cp, self.strategy, self.model_name, self.config = cp, strategy, model_name, config
        self.patched = patched
        self.session: Session | None = None
        self.attention_calls = 0  # in the current forward, checked after it
        self.documents: tuple | None = None  # per row Packed of the current forward (packed rows), or None
        self.documents_from: torch.Tensor | None = None  # the cu_seq_lens_q tensor `documents` was read from
        self.branches: tuple | None = None  # per row Branches or None of the current forward (longdoc.hf.pairs)
        self.row_lengths: torch.Tensor | None = None  # (batch,) real row lengths of a padded batch (cp.shard_batch)
        self.local_len = 0  # local tokens of the current forward
        self.ce_share: torch.Tensor | None = None  # the cross-entropy loss share of the current forward
        self.router_problem: tuple[str, str] | None = None  # why the model's MoE router loss is refused, if it is
        self.loss_calls = 0
        # layer -> the pattern its last training/prefill forward computed: LayerPattern.seen(...), for reports
        # (`longdoc verify` prints which patterns a run exercised)
        self.patterns_seen: dict = {}
        self.kind_calls: dict[str, int] = {}  # layer kinds (longdoc.hf.kinds) run in the current forward, by name
        self.layer_kinds: tuple = ()  # the LayerKinds of the model's swapped modules (longdoc.hf.kinds.attach)
        self.restore: tuple | None = None  # (attn implementation, had own loss_function, that loss_function)
        self.masks_seen: list | None = None  # the shapes of the masks the current forward built (mask_probe)
        # longdoc.hf.patch.chunked_loss: (chunk tokens, stats dict or None) while it is on, else None; and the
        # current forward's decoder output, head and probe rows when its loss is chunked
        self.loss_chunk: tuple | None = None
        self.chunk_call: tuple | None = None

    @property
    def mode(self) -> str:
        return "train" if self.session is None else self.session.mode

    def __deepcopy__(self, memo) -> CPHandle:
        return self

    def __reduce__(self):
        return (CPHandle, (None, self.strategy, self.model_name))

    def __repr__(self) -> str:
        return f"CPHandle({self.cp!r}, strategy={self.strategy!r}, model={self.model_name!r}, mode={self.mode!r})"


# ---- handles and the implementation switch ----

def handle_of(module: torch.nn.Module) -> CPHandle:
    handle = getattr(module, "_longdoc_cp", None)
    if handle is None or (handle.cp is None and handle.session is None):
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation={NAME!r} but its model is not patched "
            f"(or was unpickled/unpatched); call longdoc.patch(model, cp) on the model first"
        )
    if handle.mode == "idle":
        raise RuntimeError(f"{type(module).__name__} was called directly inside a longdoc KVSession; run the "
                           f"model through the session (prefill / extend / decode) or longdoc.hf.generate")
    return handle


def attach(hf, handle: CPHandle | None) -> None:
    """Put `handle` on every module of `hf` (None removes it)."""
    for m in hf.modules():
        if handle is None:
            m.__dict__.pop("_longdoc_cp", None)
        else:
            m._longdoc_cp = handle


def set_implementation(hf, implementation: str) -> None:
    """The one place a model's attention implementation is switched (to NAME, or back to its own)."""
    if implementation == NAME:
        name = model_name(hf)
        if not type(hf)._can_set_attn_implementation():
            raise refuse(name, "attention code that does not go through transformers' AttentionInterface",
                         "only models whose attention modules call ALL_ATTENTION_FUNCTIONS can be patched")
        register()
    hf.set_attn_implementation(implementation)
    if implementation == NAME and hf.config._attn_implementation != NAME:
        raise refuse(model_name(hf), "an attention implementation that cannot be switched",
                     "load the model with attn_implementation='sdpa' and patch again")


def check_all_layers(handle: CPHandle, n_layers: int) -> None:
    """After a forward: every attention layer went through NAME (else the result is not exact); n_layers counts
    the layers with attention (longdoc.hf.kinds.attention_layers)."""
    if handle.attention_calls < n_layers:
        raise RuntimeError(f"longdoc.patch: only {handle.attention_calls} of {n_layers} layers of {handle.model_name} "
                           f"ran their attention through the CP path; the model does not send attention through "
                           f"transformers' AttentionInterface everywhere, its outputs are NOT context-parallel-exact")


# ---- the per-call checker and the attention function ----

@dataclass(frozen=True)
class LayerPattern:
    """One layer's attention pattern, as longdoc.attention takes it (None = absent)."""

    window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return {"window": self.window, "chunk_size": self.chunk_size, "softcap": self.softcap, "sinks": self.sinks}

    def seen(self, length: int, documents: int) -> tuple:
        """What this call computed, as plain data: (window, chunk, softcap, sinks, documents in the row, length)
        over a global row of `length` tokens; a window or chunk that covers the whole row hides nothing."""
        return (self.window if self.window is not None and self.window < length else None,
                self.chunk_size if self.chunk_size is not None and self.chunk_size < length else None,
                self.softcap, self.sinks is not None, documents, length)


def _layer_type(handle: CPHandle, module) -> str | None:
    types = getattr(handle.config.get_text_config() if handle.config is not None else None, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    return types[idx] if types and idx is not None and 0 <= idx < len(types) else None


def layer_pattern(handle: CPHandle, module, kwargs: dict) -> LayerPattern | tuple[str, str]:
    """This call's pattern, or (feature, fix) when it is one the CP core does not compute."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if window is not None and not positive_int(window):
        return f"a sliding window of unsupported form ({window!r})", "use an int window >= 1 (or none)"
    chunk = None
    text = handle.config.get_text_config() if handle.config is not None else None
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        kind = _layer_type(handle, module)
        if kind is None:
            return ("chunked attention layers whose attention module has no layer_idx",
                    "the layer's type (config.layer_types) decides its chunking; run this model without CP")
        chunk = text.attention_chunk_size if kind == "chunked_attention" else None
    softcap = kwargs.get("softcap")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        return f"logit soft-capping of unsupported form ({softcap!r})", "use a positive float softcap"
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None and (not torch.is_tensor(sinks) or sinks.dim() != 1):
        return (f"attention sinks of unsupported form ({type(sinks).__name__})",
                "sinks must be a (q_heads,) tensor, one logit per query head")
    return LayerPattern(window, chunk, float(softcap) if softcap is not None else None, sinks)


def no_mask(batch_size: int, q_length: int, kv_length: int, device) -> torch.Tensor:
    """The mask function's answer for models with indexed attention layers (their code slices the mask for the
    indexer): an all-True (batch, 1, q, kv) view of one element, marked, that the attention function reads
    as no mask. The swapped indexer (longdoc.hf.kinds.dsa) never looks at it."""
    mask = torch.ones((), dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
    mask._longdoc_no_mask = True
    return mask


def is_no_mask(mask) -> bool:
    return mask is not None and getattr(mask, "_longdoc_no_mask", False)


def _selected_problem(indices, query) -> tuple[str, str] | None:
    if indices is None:
        return None
    if not torch.is_tensor(indices) or indices.is_floating_point() or indices.dim() != 3 \
            or tuple(indices.shape[:2]) != (query.shape[0], query.shape[2]):
        return (f"sparse attention indices of unsupported form ({type(indices).__name__} "
                f"{tuple(getattr(indices, 'shape', ()))})",
                "indices must be (batch, queries, k) integer key positions, as the DSA indexer returns them")
    return None


def _problem(handle: CPHandle, module, query, key, attention_mask, dropout, is_causal,
             kwargs) -> tuple[str, str] | None:
    """(feature, fix) when this attention call asks for something the current mode does not compute."""
    mode = handle.mode
    if attention_mask is not None and not is_no_mask(attention_mask):
        shape = tuple(getattr(attention_mask, "shape", ()))
        if mode != "train":
            return (f"an attention mask {shape}",
                    "generate from unpadded prompts (one prompt, or prompts of equal length) without a mask")
        return (f"a custom {len(shape)}-D attention mask {shape}",
                "pass a 2-D padding attention_mask (or none) and let cp.shard_batch build the batch; for packed "
                "documents pass position_ids restarting at 0 per document (DataCollatorWithFlattening's format)")
    if mode not in ("extend", "branch") and key.shape[2] != query.shape[2]:
        return (f"attention over a KV cache or other keys ({key.shape[2]} keys for {query.shape[2]} queries)",
                "call the model with use_cache=False and no past cache; to decode, use "
                "longdoc.hf.generate(model, cp, input_ids, max_new_tokens)")
    if dropout:
        return (f"attention dropout in training mode (p={dropout})",
                "set config.attention_dropout = 0 (and reload/re-init the attention modules if they read "
                "it at construction), or call model.eval() for evaluation and generation")
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
    cu = kwargs.get("cu_seq_lens_q")
    if mode == "train" and cu is not None and handle.documents is None and not torch.is_tensor(cu):
        return (f"cu_seq_lens_q of unsupported form ({type(cu).__name__})",
                "pass packed rows built by cp.shard_batch (global document boundaries as a 1-D tensor)")
    return _selected_problem(kwargs.get("indices"), query)


def pad_head_dims(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Zero-pad q/k or v to one head_dim (models such as MLA have v_dim != qk_dim): zero columns of q and k
    add nothing to the scores, zero columns of v give output columns that are sliced off. Exact."""
    width = max(key.shape[-1], value.shape[-1])

    def pad(t: torch.Tensor) -> torch.Tensor:
        return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    return pad(query), pad(key), pad(value)


def cp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: (batch, heads, len, head_dim) -> (batch, len, heads, head_dim), like
    `sdpa_attention_forward`; exact CP attention, or decoding over the sharded cache (see the module doc)."""
    handle = handle_of(module)
    problem = _problem(handle, module, query, key, attention_mask, dropout, is_causal, kwargs)
    pattern = layer_pattern(handle, module, kwargs) if problem is None else None
    if isinstance(pattern, tuple):
        problem = pattern
    elif pattern is not None and handle.mode in ("train", "prefill"):
        cp = handle.cp if handle.session is None else handle.session.cp
        problem = mask_probe.mismatch(handle, pattern.window, pattern.chunk_size is not None,
                                      query.shape[2] * cp.size)
    if problem is not None:
        raise refuse(handle.model_name, *problem)
    if query_temperature.is_tuned(module):  # Llama 4 NoPE layers: the queries' scale from each token's row index
        docs = call_documents(handle, kwargs.get("cu_seq_lens_q"), query.shape[0], query.shape[2]) \
            if handle.session is None else None
        query = query_temperature.scale_queries(module, handle, query, docs)

    if torch.is_autocast_enabled(query.device.type):
        # Under autocast SDPA (which this replaces) runs in the autocast dtype; RoPE leaves q and k in fp32
        # while v comes out of its projection in bf16.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5  # before any zero-padding of the head dims
    v_dim = value.shape[-1]
    query, key, value = pad_head_dims(query, key, value)
    session = handle.session
    selected = kwargs.get("indices")  # sparse indexed attention: the indexer's GLOBAL key positions per query
    if session is None:
        out = _train_attention(handle, query, key, value, scaling, pattern, kwargs.get("cu_seq_lens_q"), selected,
                               layer=getattr(module, "layer_idx", id(module)))
    elif session.mode == "prefill":
        out = attention(query, key, value, session.cp, causal=True, scale=scaling, strategy=session.strategy,
                        selected=selected, **pattern.kwargs())
    elif session.branch is not None:
        out = branches.branch_attention(query, key, value, session.branch, module.layer_idx, session.cp, scaling,
                                        pattern, selected)
    else:
        out = decode.extend_attention(query, key, value, session.cp, scaling, session.appending,
                                      pattern=pattern, start=session.total - query.shape[2],
                                      key_positions=session.key_positions, selected=selected)
    handle.attention_calls += 1
    # (batch, q_heads, len, head_dim) -> (batch, len, q_heads, v_dim), what HF modules expect
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


def call_documents(handle: CPHandle, cu: torch.Tensor | None, bsz: int, local_len: int) -> tuple | None:
    """This call's packed documents: from its own cu_seq_lens_q when the model passes it down (so an
    activation-checkpointing recompute after another forward still sees its own batch's documents), else
    from the forward pre-hook."""
    if cu is None or cu is handle.documents_from:
        return handle.documents
    docs = tuple(documents_of(cu, bsz, local_len * handle.cp.size))
    for d in docs:
        d.check(handle.cp.size)
    return docs


def _train_attention(handle: CPHandle, query, key, value, scaling: float, pattern: LayerPattern,
                     cu: torch.Tensor | None = None, selected: torch.Tensor | None = None,
                     layer=None) -> torch.Tensor:
    docs = call_documents(handle, cu, query.shape[0], query.shape[2])
    handle.patterns_seen[layer] = pattern.seen(query.shape[2] * handle.cp.size,
                                               max((len(d.doc_lens) for d in docs), default=1) if docs else 1)
    run = functools.partial(attention, cp=handle.cp, causal=True, scale=scaling, strategy=handle.strategy,
                            **pattern.kwargs())
    if docs is None:
        return run(query, key, value, selected=selected)
    rows = pairs.of_call(handle, cu) or (None,) * len(docs)  # preference pairs (sibling branches) per row
    if all(d == docs[0] for d in docs) and all(r == rows[0] for r in rows):
        return run(query, key, value, documents=docs[0], branches=rows[0], selected=selected)
    # Rows packed differently are zigzagged differently: one CP attention per row (every rank loops alike).
    return torch.cat([run(query[b:b + 1], key[b:b + 1], value[b:b + 1], documents=docs[b], branches=rows[b],
                          selected=selected[b:b + 1] if selected is not None else None)
                      for b in range(query.shape[0])], dim=0)


def _indexed(config) -> bool:
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return "indexed_attention" in (getattr(text, "layer_types", None) or ())


def cp_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs) -> torch.Tensor | None:
    """Mask function for AttentionMaskInterface: never builds a mask (no (L x L) tensor per rank).

    The 2-D padding mask, if any, was checked to be right padding by the patched model's forward
    pre-hook; 4-D masks never reach this function (transformers passes them through unchanged and
    `cp_attention_forward` refuses them). Models with indexed attention layers get `no_mask` (their code
    slices the mask)."""
    mask_probe.record(kwargs.get("mask_function"), kv_length)
    if _indexed(kwargs.get("config")):
        return no_mask(batch_size, q_length, kv_length, kwargs.get("device") or "cpu")
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
