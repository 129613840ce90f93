"""`patch(model, cp)`: run a Hugging Face causal LM with exact context-parallel attention.

    model = longdoc.patch(model, cp)          # any causal LM that uses transformers' AttentionInterface
    local = cp.shard_batch(batch)             # this rank's tokens, global positions, pre-shifted labels
    model(**local).loss.backward()            # loss = this rank's share; sum over CP = single-device mean

What patch does, all of it undoable with `unpatch(model)`:
  - switches the model to the "longdoc_cp" backend (longdoc.hf.attention registers it, never replacing
    a name): the model's own modules run unchanged;
  - puts a `CPHandle` (the cp group and the ring strategy) on the model's modules, where the
    attention function finds it: no globals, so several patched models and groups coexist;
  - replaces the causal-LM loss with the CP share (sum of token losses / global token count);
  - routes `model.generate(...)` through the CP KV session (longdoc.hf.session.generate) for the
    arguments the session supports, and refuses the others naming `longdoc.hf.generate(model, cp, ...)`;
  - adds a forward pre-hook that checks, once per call and before any communication, what only the
    whole call shows (positions, labels, padding, RoPE scaling), and a post-hook that checks every
    decoder layer's attention really went through the CP path.
Model features CP cannot reproduce exactly are refused with UnsupportedFeatureError.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from longdoc.hf import attention as backend
from longdoc.hf import modelinfo
from longdoc.hf import session as sessions
from longdoc.hf.attention import CPHandle
from longdoc.hf.modelinfo import UnsupportedFeatureError, check_config, hf_model, model_name, refuse, rope_limit
from longdoc.parallel import comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.api import ContextParallel, check_strategy
from longdoc.parallel.batch import CPInputError, documents_of

__all__ = ["patch", "unpatch", "is_patched", "UnsupportedFeatureError", "CPInputError"]

def _cp_loss(handle: CPHandle, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """This rank's loss share: sum of its token losses / global loss-token count (labels pre-shifted)."""
    handle.loss_calls += 1
    if shift_labels is None or num_items_in_batch is None:
        raise ValueError("under CP the loss needs labels shifted over the full sequence (shift_labels) and the "
                         "global loss-token count (num_items_in_batch); build the batch with cp.shard_batch")
    logits = logits.float().reshape(-1, vocab_size)
    target = shift_labels.reshape(-1).to(logits.device)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


# ---- per-call checks (forward pre-hook) ----

def _right_padded(mask: torch.Tensor) -> bool:
    """Every row is ones then zeros (or all ones / all zeros)."""
    m = mask.to(torch.int8)
    return bool((m[:, 1:] <= m[:, :-1]).all()) if m.shape[1] > 1 else True


class _Input(tuple):
    """A (what, fix) problem with the call's inputs rather than with a model feature."""

    def __new__(cls, what: str, fix: str):
        return super().__new__(cls, (what, fix))


def _raise(handle: CPHandle, problem: tuple[str, str]):
    if isinstance(problem, _Input):
        raise CPInputError(f"longdoc.patch: {handle.model_name} was called with {problem[0]} under context "
                           f"parallelism; {problem[1]}")
    raise refuse(handle.model_name, *problem)


_PADDING_FIX = ("build the local batch with cp.shard_batch: it turns left padding into right padding (which "
                "needs no mask) and passes no attention_mask on")


def _call_problem(handle: CPHandle, call: dict) -> tuple[str, str] | None:
    cp = handle.cp
    x = call.get("input_ids")
    x = call.get("inputs_embeds") if x is None else x
    if x is None or x.dim() < 2:
        return None  # the model itself raises its own clear error
    cache = call.get("cache", call.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        return ("a filled KV cache", "a plain forward under CP runs without one (use_cache=False); to decode, "
                "call longdoc.hf.generate(model, cp, input_ids, max_new_tokens) or model.generate, which routes "
                "there")
    local_len = x.shape[1]
    global_len = local_len * cp.size
    pos = call.get("position_ids")
    if pos is None:
        return _Input("no position_ids", "under CP every rank must pass the GLOBAL positions of its tokens "
                "(cp.shard_batch provides them); without them RoPE would see local positions")
    cu = call.get("cu_seq_lens_q")
    if cu is not None:
        if call.get("cu_seq_lens_k") is not None and not torch.equal(call["cu_seq_lens_k"], cu):
            return _Input("cu_seq_lens_k different from cu_seq_lens_q", "pass the batch cp.shard_batch made")
        try:
            docs = documents_of(cu, x.shape[0], global_len)
            for d in docs:
                d.check(cp.size)
        except ValueError as e:
            return _Input("cu_seq_lens_q that are not the global document boundaries of this batch",
                          f"pass the packed batch cp.shard_batch made ({e})")
        expected = torch.stack([cp.shard(d.position_ids(pos.device), dim=0, documents=d) for d in docs])
        if pos.shape != expected.shape or not bool((pos == expected).all()):
            return _Input("position_ids that are not this rank's positions within its packed documents",
                          "pass the position_ids made by cp.shard_batch for the packed batch")
        handle.documents, handle.documents_from = tuple(docs), cu
    else:
        chunks = len(layouts.chunk_ids(cp.layout, 0, cp.size))
        if local_len % chunks:
            return _Input(f"a local sequence of {local_len} tokens", f"the {cp.layout} layout holds {chunks} equal "
                          f"chunks per rank; build the local batch with cp.shard_batch, which pads")
        # Each row: this rank's global positions plus one offset >= 0 (a row numbered from another start,
        # such as a left-padded row that cp.shard_batch rolled to the right, every token keeping its id).
        bad = _Input("position_ids that are not this rank's global positions",
                     "pass the position_ids made by cp.shard_batch (it handles packed rows and left padding)")
        if pos.shape[-1] != local_len:
            return bad
        offset = pos - cp.positions(global_len, device=pos.device)
        if not bool((offset == offset[..., :1]).all()) or bool((offset < 0).any()):
            return bad
        if offset.numel():
            global_len += int(offset.max())  # the largest position id + 1, for the RoPE threshold below
    if call.get("labels") is not None and call.get("shift_labels") is None:
        return _Input("labels without shift_labels", "labels must be shifted over the FULL sequence before sharding; "
                "build the batch with cp.shard_batch (it passes shift_labels and num_items_in_batch)")
    if call.get("shift_labels") is not None and call.get("num_items_in_batch") is None:
        return _Input("shift_labels without num_items_in_batch", "pass the global number of loss tokens "
                "(cp.shard_batch does) so that the per-rank losses sum to the mean")
    if call.get("output_router_logits"):
        return ("the MoE router auxiliary loss (output_router_logits=True)",
                "it is a non-linear function of whole-sequence router statistics; call without it")
    limit = rope_limit(handle.config)
    if limit is not None and global_len > limit[1]:
        return (f"RoPE scaling {limit[0]!r} at {global_len} tokens (beyond its {limit[1]}-token threshold)",
                "this scaling picks frequencies from the largest position id each rank sees, which differs "
                "per rank; use sequences within the threshold or a static RoPE scaling (linear, yarn, llama3)")
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return (f"a custom {mask.dim()}-D attention mask", "pass a 2-D right-padding mask, or none")
    return None


def _vocab_problem(module, call: dict) -> _Input | None:
    # An id past the embedding is an IndexError deep in torch on CPU and a device-side assert on GPU;
    # a negative one would silently index from the end. Checked here, it is one clear error on every rank.
    ids = call.get("input_ids")
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if ids is None or n is None or ids.numel() == 0 or ids.is_floating_point():
        return None
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= n:
        return _Input(f"token ids spanning [{low}, {high}] (its embedding has {n} rows, ids 0..{n - 1})",
                      "the ids come from another tokenizer or from a bad padding id; tokenize with this model's "
                      "tokenizer (len(tokenizer) must not exceed the embedding; see model.resize_token_embeddings)")
    return None


def _pre_forward(handle: CPHandle, signature: inspect.Signature, module, args, kwargs):
    if handle.session is not None:
        return None  # a KVSession's own call: it checked its inputs (or the caller ran a plain reference)
    cp = handle.cp
    if cp is None:
        backend.handle_of(module)  # raises: unpickled or unpatched model
    handle.attention_calls = 0
    handle.loss_calls = 0
    handle.documents = handle.documents_from = None
    call = signature.bind_partial(*args, **kwargs).arguments
    call = {**call.pop("kwargs", {}), **call}
    problem = _call_problem(handle, call) or _vocab_problem(module, call)
    mask = call.get("attention_mask")
    has_pad = mask is not None and mask.dim() == 2 and not bool(mask.all())
    if cp.size > 1 and cp.check_agreement:
        # One tiny collective per call so every rank raises the same error instead of some hanging.
        metas = comm.agree([problem is not None, has_pad], cp.group, cp.timeout, cp.comm_device(module.device))
        bad = [r for r, m in enumerate(metas) if m[0]]
        if problem is None and bad:
            raise RuntimeError(f"longdoc.patch: CP rank {bad[0]} rejected this call's inputs to "
                               f"{handle.model_name} (its error says why); all ranks stop here")
        any_pad = any(m[1] for m in metas)
    else:
        any_pad = has_pad
    if problem is not None:
        _raise(handle, problem)
    if any_pad:
        if cp.size == 1:
            full = mask
        elif cp.check_agreement:
            local = mask.to(torch.uint8) if mask is not None else None
            if local is None:
                x = call.get("input_ids", call.get("inputs_embeds"))
                local = torch.ones(x.shape[:2], dtype=torch.uint8, device=x.device)
            full = cp.gather(local, dim=1)
        else:
            raise refuse(handle.model_name, "an attention_mask with padding under check_agreement=False",
                         "drop the mask: cp.shard_batch pads on the right and needs none")
        if not _right_padded(full):
            raise refuse(handle.model_name, "left padding or holes in attention_mask", _PADDING_FIX)
    return None


def _post_forward(handle: CPHandle, n_layers: int, module, args, kwargs, output):
    if handle.session is not None:
        return None  # the session checks its own calls
    backend.check_all_layers(handle, n_layers)
    loss = getattr(output, "loss", None)
    if loss is not None and handle.loss_calls == 0:
        raise RuntimeError(f"longdoc.patch: {handle.model_name} computed its loss without model.loss_function, "
                           f"so the CP loss share was bypassed; compute the loss from local logits yourself")
    return None


# ---- model.generate on a patched model: routed through the CP KV session ----

_GENERATE_ARGS = ("input_ids", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "eos_token_id",
                  "pad_token_id", "attention_mask", "use_cache")
_HARMLESS = {"num_beams": 1, "num_return_sequences": 1, "return_dict_in_generate": False}  # the defaults
GENERATE_CALL = ("longdoc.hf.generate(model, cp, input_ids, max_new_tokens, eos_token_id=..., do_sample=..., "
                 "temperature=..., top_p=..., top_k=..., seed=...)")


def _generate_call(hf, args: tuple, kwargs: dict) -> tuple[dict, str | None]:
    """The call's arguments by name, and what in them the CP session cannot run (or None)."""
    call = dict(kwargs)
    if "inputs" in call:
        call["input_ids"] = call.pop("inputs")
    if args:
        if len(args) > 1 or "input_ids" in call:
            return call, f"{len(args)} positional argument(s) besides the keyword ones"
        call["input_ids"] = args[0]
    extra = sorted(k for k, v in call.items()
                   if k not in _GENERATE_ARGS and v is not None and _HARMLESS.get(k, object()) != v)
    if extra:
        return call, f"the argument(s) {', '.join(extra)}"
    ids = call.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point() or ids.shape[1] == 0:
        return call, "no (batch, len) integer input_ids"
    if call.get("max_new_tokens") is None and getattr(hf.generation_config, "max_new_tokens", None) is None:
        return call, "no max_new_tokens"
    mask = call.get("attention_mask")
    if mask is not None:
        try:
            sessions.left_padding(mask, tuple(ids.shape))
        except (ValueError, RuntimeError):
            return call, "an attention_mask that is not left padding (padding_side='left')"
    return call, None


def _generate(handle: CPHandle, hf, *args, **kwargs) -> torch.Tensor:
    """`model.generate(...)` for a patched model: prompt + new ids (batch, len + new), like transformers'."""
    if handle.cp is None:
        backend.handle_of(hf)  # raises: unpickled model
    cp = handle.cp
    call, problem = _generate_call(hf, args, kwargs)
    if cp.size > 1 and cp.check_agreement:
        device = call["input_ids"].device if torch.is_tensor(call.get("input_ids")) else torch.device("cpu")
        bad = [r for r, m in enumerate(comm.agree([problem is not None], cp.group, cp.timeout,
                                                    cp.comm_device(device))) if m[0]]
        if problem is None and bad:
            problem = f"arguments CP rank {bad[0]} cannot run (its error says which)"
    if problem is not None:
        raise CPInputError(f"longdoc.patch: model.generate on {handle.model_name} under context parallelism got "
                           f"{problem}; it supports {', '.join(_GENERATE_ARGS)} (attention_mask with left "
                           f"padding, the same prompt on every rank). For anything else call {GENERATE_CALL}")
    config = hf.generation_config

    def pick(name: str):
        value = call.get(name)
        return getattr(config, name, None) if value is None else value

    ids, sample = call["input_ids"], bool(pick("do_sample"))
    eos, pad = pick("eos_token_id"), pick("pad_token_id")
    out = sessions.generate(hf, cp, ids, int(pick("max_new_tokens")), eos_token_id=eos, do_sample=sample,
                            temperature=(pick("temperature") or 1.0) if sample else 1.0,
                            top_p=(pick("top_p") or 1.0) if sample else 1.0,
                            top_k=(pick("top_k") or None) if sample else None, strategy=handle.strategy,
                            attention_mask=call.get("attention_mask"))
    tokens = out.tokens.to(ids.device)
    if eos is not None and pad is not None:
        # transformers fills a finished row with pad_token_id after its EOS (the session repeats the EOS)
        is_eos = torch.isin(tokens, torch.as_tensor(eos, device=tokens.device).reshape(-1))
        tokens = tokens.masked_fill(is_eos.cumsum(dim=1) - is_eos.long() > 0, int(pad))
    return torch.cat([ids, tokens], dim=1)


def patch(model: torch.nn.Module, cp: ContextParallel, *, strategy: str = "ring") -> torch.nn.Module:
    """Make `model` (a transformers causal LM, or a wrapper such as PEFT holding one) run its attention
    as exact context-parallel attention over `cp`. Returns the same model object, patched in place.

    strategy: "ring" (K/V rotate, O(local) memory) or "allgather" (K/V gathered per layer).
    Raises UnsupportedFeatureError for features CP cannot reproduce exactly.
    """
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"cp must be a longdoc.ContextParallel, got {type(cp).__name__}")
    check_strategy(strategy)
    hf = hf_model(model)
    if is_patched(hf):
        unpatch(hf)
    name = model_name(hf)
    check_config(hf.config, name)
    original = hf.config._attn_implementation
    backend.set_implementation(hf, backend.NAME)
    handle = CPHandle(cp, strategy, name, hf.config)
    backend.attach(hf, handle)
    had_loss = "_loss_function" in hf.__dict__
    old_loss = hf.__dict__.get("_loss_function")
    hf.loss_function = functools.partial(_cp_loss, handle)
    hf.generate = functools.partial(_generate, handle, hf)  # model.generate decodes through the CP session
    n_layers = modelinfo.num_layers(hf.config)
    hf.register_forward_pre_hook(functools.partial(_pre_forward, handle, inspect.signature(hf.forward)),
                                 with_kwargs=True)
    hf.register_forward_hook(functools.partial(_post_forward, handle, n_layers), with_kwargs=True)
    handle.restore = (original, had_loss, old_loss)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    handle = getattr(hf_model(model), "_longdoc_cp", None)
    return handle is not None and handle.patched


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: restore the previous attention implementation and loss, remove hooks and handles."""
    hf = hf_model(model)
    handle = getattr(hf, "_longdoc_cp", None)
    if handle is None:
        return model
    original, had_loss, old_loss = handle.restore or ("sdpa", False, None)
    # Found by function rather than by the RemovableHandles, which a deep copy of the model would not follow.
    for hooks in (hf._forward_pre_hooks, hf._forward_hooks):
        for key in [k for k, h in hooks.items() if getattr(h, "func", None) in (_pre_forward, _post_forward)]:
            hooks.pop(key)
            hf._forward_hooks_with_kwargs.pop(key, None)
            hf._forward_pre_hooks_with_kwargs.pop(key, None)
    backend.attach(hf, None)
    if getattr(hf.__dict__.get("generate"), "func", None) is _generate:
        del hf.__dict__["generate"]
    if had_loss:
        hf._loss_function = old_loss
    else:
        hf.__dict__.pop("_loss_function", None)
    backend.set_implementation(hf, original)
    return model
