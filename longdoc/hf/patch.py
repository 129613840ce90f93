"""`patch(model, cp)`: run a Hugging Face causal LM with exact context-parallel attention.

    model = longdoc.patch(model, cp)          # any causal LM that uses transformers' AttentionInterface
    local = cp.shard_batch(batch)             # this rank's tokens, global positions, pre-shifted labels
    model(**local).loss.backward()            # loss = this rank's share; sum over CP = single-device mean

What patch does, all of it undoable with `unpatch(model)`:
  - switches the model to the "longdoc_cp" backend (longdoc.hf.attention registers it, never replacing
    a name): the model's own modules run unchanged;
  - puts a `CPHandle` (the cp group and the CP strategy) on the model's modules, where the
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

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from longdoc.hf import attention as backend
from longdoc.hf import head as heads
from longdoc.hf import kinds, mask_probe, modelinfo, router
from longdoc.hf import session as sessions
from longdoc.hf.attention import CPHandle
from longdoc.hf.call_checks import (
    PADDING_FIX,
    InputProblem,
    call_problem,
    layerdrop_problem,
    right_padded,
    row_lengths_problem,
    vocab_problem,
)
from longdoc.hf.modelinfo import UnsupportedFeatureError, check_config, hf_model, model_name, refuse
from longdoc.parallel import comm
from longdoc.parallel.api import ContextParallel, check_strategy
from longdoc.parallel.batch import ROW_LENGTHS, CPInputError
from longdoc.parallel.batch_branches import BRANCHES

M = TypeVar("M", bound=torch.nn.Module)  # patch / unpatch hand back the model's own class
__all__ = ["patch", "unpatch", "is_patched", "chunked_loss", "UnsupportedFeatureError", "CPInputError"]
PROBE_ROWS = 4  # logits the model itself computes under chunked_loss, to check the chunked head against

def _cp_loss(handle: CPHandle, logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """This rank's loss share: sum of its token losses / global loss-token count (labels pre-shifted)."""
    handle.loss_calls += 1
    if shift_labels is None or num_items_in_batch is None:
        raise ValueError("under CP the loss needs labels shifted over the full sequence (shift_labels) and the "
                         "global loss-token count (num_items_in_batch); build the batch with cp.shard_batch")
    if handle.chunk_call is not None:
        loss = _chunked_share(handle, logits, shift_labels)
    else:
        logits = logits.float().reshape(-1, vocab_size)
        target = shift_labels.reshape(-1).to(logits.device)
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    handle.ce_share = loss / num_items_in_batch
    return handle.ce_share.clone()  # MoE models add their router loss to it in place (`loss += ...`)


def _chunked_share(handle: CPHandle, probe_logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """The summed token losses from the decoder's output, a chunk of loss tokens at a time (chunked_loss), after
    checking the model's own logits of the probe rows against the chunked head (an unknown final transform)."""
    holder, head, rows = handle.chunk_call
    chunk, stats = handle.loss_chunk
    h = holder["h"]  # (batch, local_len, hidden)
    check_probe(handle.model_name, probe_logits, head, h[:, :rows])
    return heads.chunked_ce_sum(head, h, shift_labels.to(h.device), chunk, stats=stats)


def check_probe(name: str, probe_logits: torch.Tensor, head: heads.LogitHead, h: torch.Tensor) -> None:
    """Refuse by name when the model's own logits of a few positions are not `head` of their hidden states `h` (an
    unknown final transform would make a loss computed from hidden states differ from the model's)."""
    if not h.shape[1]:
        return
    want = probe_logits.detach().float()
    got = head(h.detach()).float()
    err, scale = (want - got).abs().max().item(), want.abs().max().item()
    if not err <= 1e-3 * max(1.0, scale):
        raise refuse(name, f"a chunked loss (its logits are not lm_head(decoder(x)): max difference {err:.3g})",
                     "compute the loss without longdoc.hf.chunked_loss")


@contextlib.contextmanager
def chunked_loss(model: torch.nn.Module, chunk_tokens: int | None = None,
                 stats: dict | None = None) -> Iterator[None]:
    """While the block runs, a labelled forward of the patched `model` computes its loss share from the decoder's
    hidden states, `chunk_tokens` loss tokens at a time (None: sized from the vocabulary, longdoc.hf.head
    .loss_chunk_tokens), so the (local tokens x vocabulary) logits are never built. The output's logits are then
    those of the first PROBE_ROWS positions only, which each call checks the chunked head against. With `stats`
    (a dict) each chunk leaves its token statistics there (longdoc.hf.head.chunked_ce_sum). A forward that passes
    `logits_to_keep` itself, or a model whose forward takes none, computes its logits as usual."""
    hf = hf_model(model)
    handle = backend.handle_of(hf)
    vocab = hf.get_output_embeddings().weight.shape[0] if hf.get_output_embeddings() is not None else 1
    saved = handle.loss_chunk
    handle.loss_chunk = (chunk_tokens or heads.loss_chunk_tokens(vocab), stats)
    try:
        yield
    finally:
        handle.loss_chunk = saved


def _begin_chunked(handle: CPHandle, signature: inspect.Signature, module, call: dict, kwargs: dict):
    """Under chunked_loss, a labelled call keeps PROBE_ROWS logits and hands the decoder's output to the loss."""
    handle.chunk_call = None
    if handle.loss_chunk is None or "logits_to_keep" not in signature.parameters or "logits_to_keep" in call:
        return
    if call.get("labels") is None and call.get("shift_labels") is None:
        return
    decoder = module.get_decoder() if hasattr(module, "get_decoder") else None
    if decoder is None or module.get_output_embeddings() is None:
        return
    holder: dict = {}

    def grab(mod, args, output):
        holder["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        holder["hook"].remove()

    holder["hook"] = decoder.register_forward_hook(grab)
    rows = min(PROBE_ROWS, handle.local_len)
    x = call.get("input_ids", call.get("inputs_embeds"))
    kwargs["logits_to_keep"] = torch.arange(rows, device=x.device)
    handle.chunk_call = (holder, heads.LogitHead(module), rows)


# ---- per-call checks (forward pre-hook) ----

def _raise(handle: CPHandle, problem: tuple[str, str]):
    if isinstance(problem, InputProblem):
        raise CPInputError(f"longdoc.patch: {handle.model_name} was called with {problem[0]} under context "
                           f"parallelism; {problem[1]}")
    raise refuse(handle.model_name, *problem)


def _pre_forward(handle: CPHandle, signature: inspect.Signature, module, args, kwargs):
    lengths = kwargs.pop(ROW_LENGTHS, None)  # cp.shard_batch's real row lengths: for longdoc, never the model
    branches = kwargs.pop(BRANCHES, None)  # and its preference pairs (longdoc.hf.pairs)
    mask_probe.begin(handle)
    if handle.session is not None:
        if branches is not None:
            raise refuse(handle.model_name, "preference pairs (longdoc_branches) in a KV session's call",
                         "sessions prefill and decode plain rows; pass branches to training forwards only")
        return args, kwargs  # a KVSession's own call: it checked its inputs (or the caller ran a plain reference)
    cp = handle.cp
    if cp is None:
        backend.handle_of(module)  # raises: unpickled or unpatched model
    handle.attention_calls = 0
    handle.loss_calls = 0
    handle.kind_calls = {}
    handle.documents = handle.documents_from = handle.branches = None
    handle.row_lengths = None
    call = signature.bind_partial(*args, **kwargs).arguments
    call = {**call.pop("kwargs", {}), **call}
    x = call.get("input_ids", call.get("inputs_embeds"))
    global_len = x.shape[1] * cp.size if x is not None and x.dim() >= 2 else 0
    handle.local_len = x.shape[1] if x is not None and x.dim() >= 2 else 0
    problem = call_problem(handle, call, branches) or vocab_problem(module, call) or \
        row_lengths_problem(lengths, call, global_len) or layerdrop_problem(module)
    mask = call.get("attention_mask")
    has_pad = mask is not None and mask.dim() == 2 and not bool(mask.all())
    if cp.size > 1 and cp.check_agreement:
        # One tiny collective per call so every rank raises the same error instead of some hanging.
        metas = comm.agree([problem is not None, has_pad], cp.group, cp.timeout, cp.comm_device(module.device),
                           cp.guard, "agree forward call")
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
        if not right_padded(full):
            raise refuse(handle.model_name, "left padding or holes in attention_mask", PADDING_FIX)
    handle.row_lengths = lengths
    _begin_chunked(handle, signature, module, call, kwargs)
    return args, kwargs


def _post_forward(handle: CPHandle, n_layers: int, expected: dict[str, int], module, args, kwargs, output):
    mask_probe.end(handle)
    if handle.session is not None:
        return None  # the session checks its own calls
    if handle.chunk_call is not None:
        handle.chunk_call[0]["hook"].remove()  # (already, unless the decoder never ran)
        handle.chunk_call = None
    backend.check_all_layers(handle, n_layers)
    kinds.check_calls(handle, expected)
    loss = getattr(output, "loss", None)
    if loss is not None and handle.loss_calls == 0:
        raise RuntimeError(f"longdoc.patch: {handle.model_name} computed its loss without model.loss_function, "
                           f"so the CP loss share was bypassed; compute the loss from local logits yourself")
    if getattr(output, "aux_loss", None) is not None and getattr(output, "router_logits", None):
        # transformers summed this rank's router statistics only; the loss share takes the whole sequence's
        hf = modelinfo.hf_model(module)
        aux = router.global_aux(hf, handle, tuple(output.router_logits), handle.local_len)
        output.aux_loss = aux
        if loss is not None:
            output.loss = handle.ce_share + router.coefficient(hf) * aux.to(loss.device) / handle.cp.size
        return output
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
                                                    cp.comm_device(device), cp.guard, "agree generate call"))
               if m[0]]
        if problem is None and bad:
            problem = f"arguments CP rank {bad[0]} cannot run (its error says which)"
    if problem is not None:
        raise CPInputError(f"longdoc.patch: model.generate on {handle.model_name} under context parallelism got "
                           f"{problem}; it supports {', '.join(_GENERATE_ARGS)} (attention_mask with left "
                           f"padding, the same prompt on every rank). For anything else call {GENERATE_CALL}")
    # None arguments take the model's generation_config (eos, pad, sampling, max_new_tokens) inside generate
    ids = call["input_ids"]
    out = sessions.generate(hf, cp, ids, call.get("max_new_tokens"), eos_token_id=call.get("eos_token_id"),
                            pad_token_id=call.get("pad_token_id"), do_sample=call.get("do_sample"),
                            temperature=call.get("temperature"), top_p=call.get("top_p"), top_k=call.get("top_k"),
                            strategy=handle.strategy, attention_mask=call.get("attention_mask"))
    tokens = out.tokens.to(ids.device)
    return torch.cat([ids, tokens], dim=1)


def patch(model: M, cp: ContextParallel, *, strategy: str = "ring") -> M:
    """Make `model` (a transformers causal LM, or a wrapper such as PEFT holding one) run its attention
    as exact context-parallel attention over `cp`. Returns the same model object, patched in place.

    strategy: "ring" (K/V rotate, O(local) memory), "allgather" (K/V gathered per layer), "ulysses" (heads
        all-to-all; q_heads >= cp.size) or "usp" (Ulysses x ring; cp built with ulysses_size=).
    Raises UnsupportedFeatureError for features CP cannot reproduce exactly.

    With DDP/FSDP on the same ranks, keep the collectives in order by construction (issue 22; the reasons
    are in longdoc.parallel.groups): give `cp` a group of its own, never the one gradients are reduced on
    (`ContextParallel()` means the world group, DDP's default: pass `dist.new_group(ranks)` or the cp group
    of `longdoc.parallel.groups.make_groups`); and let every trainable parameter get a gradient on every
    rank in every backward (this model's own loss does: it computes every local token's logits; a custom
    loss that skips the head on a rank without loss tokens must keep it in the graph with a zero-weighted
    term) or wrap with find_unused_parameters=True. `reduce_gradients_on(ddp_model, group)` moves DDP's
    buckets onto a group of their own too; `ContextParallel(..., debug_collectives=True)` checks every CP
    collective across the group before it is issued.
    """
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"cp must be a longdoc.ContextParallel, got {type(cp).__name__}")
    check_strategy(strategy, cp)
    hf = hf_model(model)
    if is_patched(hf):
        unpatch(hf)
    name = model_name(hf)
    check_config(hf.config, name, kinds.layer_types(hf))
    handle = CPHandle(cp, strategy, name, hf.config)
    handle.router_problem = router.problem(hf)
    own_loss = modelinfo.own_loss_problem(hf)
    if own_loss is not None:
        raise refuse(name, *own_loss)
    if handle.router_problem is not None and any(getattr(c, "output_router_logits", False)
                                                 for c in (hf.config, hf.config.get_text_config())):
        raise refuse(name, *handle.router_problem)
    problem = kinds.problems(hf, handle)  # layers other than attention: handled by a kind, or refused by name
    if problem is not None:
        raise refuse(name, *problem)
    n_layers = kinds.attention_layers(hf.config, modelinfo.num_layers(hf.config), hf)
    # A model whose every layer is a kind's (RWKV, xLSTM, pure SSMs) may have no attention interface to switch.
    original = hf.config._attn_implementation if n_layers or type(hf)._can_set_attn_implementation() else None
    if original is not None:
        backend.set_implementation(hf, backend.NAME)
    backend.attach(hf, handle)
    kinds.attach(hf, handle)
    had_loss = "_loss_function" in hf.__dict__
    old_loss = hf.__dict__.get("_loss_function")
    hf.loss_function = functools.partial(_cp_loss, handle)
    hf.generate = functools.partial(_generate, handle, hf)  # model.generate decodes through the CP session
    hf.register_forward_pre_hook(functools.partial(_pre_forward, handle, inspect.signature(hf.forward)),
                                 with_kwargs=True)
    hf.register_forward_hook(functools.partial(_post_forward, handle, n_layers, kinds.expected_calls(hf)),
                             with_kwargs=True)
    handle.restore = (original, had_loss, old_loss)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    handle = getattr(hf_model(model), "_longdoc_cp", None)
    return handle is not None and handle.patched


def unpatch(model: M) -> M:
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
    kinds.detach(hf)
    backend.attach(hf, None)
    if getattr(hf.__dict__.get("generate"), "func", None) is _generate:
        del hf.__dict__["generate"]
    if had_loss:
        hf._loss_function = old_loss
    else:
        hf.__dict__.pop("_loss_function", None)
    if original is not None:
        backend.set_implementation(hf, original)
    return model
