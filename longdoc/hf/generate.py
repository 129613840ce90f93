"""Generation under context parallelism: a sharded KV cache, prefill, extension and greedy decoding.

    with KVSession(model, cp) as s:                 # model: a transformers causal LM (patched or not)
        logits = s.prefill(prompt_ids)              # CP forward; each rank keeps the K/V of ITS tokens
        out = s.greedy(logits, max_new_tokens=32)   # identical to single-process greedy decoding
    tokens = generate(model, cp, prompt_ids, max_new_tokens=32).tokens   # the same in one call

How decoding works (every rank runs the same calls, in lockstep):
  prefill   the prompt is padded to cp.multiple and sharded by cp's layout; attention is the exact CP
            attention (`longdoc.attention`), and each layer's cache keeps this rank's K/V. The padding's
            K/V are dropped afterwards, so the cache shards hold exactly the prompt's tokens.
  extend    new tokens (one generated token, or a question / answer to score) are computed on every rank
            (replicated: they are few), with their TRUE global positions for RoPE. Their K/V are appended
            on ONE rank, the one holding the fewest cached tokens (lowest rank on a tie) so shards stay
            balanced; every rank derives the owner from the same counts, no message needed. In each layer
            a rank attends the new queries to its cache shard (causally among the new tokens on the owner),
            giving a partial (out, lse); the small partials are all-gathered and merged by log-sum-exp in
            rank order, identically on every rank.
  greedy    the argmax of rank 0 is used by all ranks, so ranks never diverge on a rounding tie.

Attention goes through a function registered with transformers' AttentionInterface as "longdoc_cp_kv"
(the model's own decoder code runs unchanged); the model's attention implementation is switched to it
for the session and restored afterwards. A model patched with `longdoc.patch` is unpatched for the
session and re-patched on exit (its forward checks refuse KV caches, rightly for training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import longdoc
from longdoc.hf import attention as cp_attn
from longdoc.hf.patch import check_config, hf_model, is_patched, model_name, patch, rope_limit, unpatch
from longdoc.parallel import blocks, comm, kernels
from longdoc.parallel import layout as layouts
from longdoc.parallel.api import STRATEGIES, ContextParallel

__all__ = ["KVSession", "ShardedCache", "Generation", "generate", "NAME"]

NAME = "longdoc_cp_kv"


class ShardedCache(DynamicCache):
    """A DynamicCache holding only this rank's tokens. While `append` is False (another rank owns the
    new tokens) `update` returns the cached shard without storing the new K/V."""

    def __init__(self) -> None:
        super().__init__()  # no config: plain DynamicLayers, never a sliding-window layer that drops tokens
        self.append = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.append:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        layer = self.layers[layer_idx]
        if not layer.is_initialized or layer.keys.dim() != key_states.dim():
            return key_states[..., :0, :], value_states[..., :0, :]
        return layer.keys, layer.values

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the cached tokens at local `index` (1-D LongTensor), in every layer."""
        for layer in self.layers:
            if layer.is_initialized and layer.keys.dim() == 4:
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))

    def truncate(self, length: int) -> None:
        """Keep the first `length` local tokens in every layer (undo appends)."""
        for layer in self.layers:
            if layer.is_initialized and layer.keys.dim() == 4:
                layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


@dataclass
class _State:
    """What the attention function needs, carried on every module of the model as `_longdoc_kv`."""

    cp: ContextParallel
    strategy: str
    model_name: str
    mode: str = "idle"  # "prefill" | "extend"
    appending: bool = True  # this rank stores the new tokens of the current extend call
    total: int = 0  # global length after the current call, for the sliding-window check


@dataclass
class Generation:
    """Greedy decoding output, identical on every rank."""

    tokens: torch.Tensor  # (batch, new_tokens) generated ids; after an EOS a row repeats that EOS
    logits: torch.Tensor | None = None  # (batch, new_tokens, vocab) fp32 logits that chose them, if asked


def _state(module: torch.nn.Module) -> _State:
    state = getattr(module, "_longdoc_kv", None)
    if state is None or state.mode == "idle":
        raise RuntimeError(f"{type(module).__name__} runs with attn_implementation={NAME!r} outside a "
                           f"longdoc KVSession; use longdoc.hf.generate.KVSession or generate()")
    return state


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             kernel: kernels.Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over one block of keys in the accumulator dtype; an empty block gives (0, -inf)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[2] == 0:
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    out, lse = kernel.forward(q, k.contiguous(), v.contiguous(), causal, scale)
    return out.to(acc), lse.to(acc)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, scale: float,
                     appending: bool) -> torch.Tensor:
    """New queries (replicated on every rank) over the keys of all ranks' cache shards.

    q (batch, q_heads, new, head_dim); k, v (batch, kv_heads, local, head_dim) this rank's shard, whose
    last `new` entries are the new tokens when `appending`. Returns (batch, q_heads, new, head_dim),
    identical on every rank.
    """
    kernel = kernels.select(q.device, q.dtype, cp.kernel)
    new = q.shape[2]
    old = k.shape[2] - new if appending else k.shape[2]
    # Every cached key precedes every new query: no mask. Among the new tokens (on the owner only) the
    # block is square and starts at the first new token, so top-left causal alignment is right.
    out, lse = _partial(q, k[:, :, :old], v[:, :, :old], False, scale, kernel)
    if appending:
        out, lse = blocks.merge(out, lse, *_partial(q, k[:, :, old:], v[:, :, old:], True, scale, kernel))
    if cp.size > 1:
        # One all-gather of (out | lse) per layer: new x head_dim numbers per head, tiny next to the cache.
        parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1), cp.group, cp.timeout)
        out = torch.zeros_like(out)
        lse = torch.full_like(lse, float("-inf"))
        for part in parts:  # rank order on every rank: bit-identical results everywhere
            out, lse = blocks.merge(out, lse, part[..., :-1], part[..., -1])
    return out.to(q.dtype)


def _check_call(state: _State, module, attention_mask, dropout: float, kwargs: dict) -> None:
    problem = None
    if attention_mask is not None:
        problem = (f"an attention mask {tuple(getattr(attention_mask, 'shape', ()))}",
                   "generate from unpadded prompts (one prompt, or prompts of equal length) without a mask")
    elif dropout:
        problem = f"attention dropout (p={dropout})", "call model.eval() before generating"
    elif kwargs.get("output_attentions"):
        problem = "output_attentions=True", "attention weights are never materialized under CP"
    else:
        for name, feature in cp_attn._UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None and kwargs.get(name) is not False:
                problem = feature, "generate with this model without CP"
                break
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if problem is None and window is not None and state.total > int(window):
            problem = (f"sliding-window attention (window {window} < {state.total} tokens)",
                       "keep prompt plus generated tokens within the window")
    if problem is not None:
        raise cp_attn.refuse(state.model_name, *problem)


def kv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function for a KVSession: prefill = exact CP attention over the sharded
    prompt; extend = new queries over every rank's cache shard, merged by log-sum-exp."""
    state = _state(module)
    _check_call(state, module, attention_mask, dropout, kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    v_dim = value.shape[-1]
    if v_dim != key.shape[-1]:
        # Zero columns change neither scores nor the kept output columns: exact, sliced off below.
        width = max(v_dim, key.shape[-1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
        query, key, value = pad(query), pad(key), pad(value)
    if state.mode == "prefill":
        if key.shape[2] != query.shape[2]:
            raise RuntimeError("KVSession.prefill needs an empty cache; start a new session (or rollback to 0)")
        out = longdoc.attention(query, key, value, state.cp, causal=True, scale=scaling, strategy=state.strategy)
    else:
        out = extend_attention(query, key, value, state.cp, scaling, state.appending)
    return out[..., :v_dim].transpose(1, 2).contiguous(), None


def register() -> None:
    """Register NAME with the AttentionInterface (no mask function: transformers then builds no mask)."""
    from transformers import AttentionInterface

    existing = AttentionInterface._global_mapping.get(NAME)
    if existing is not None and getattr(existing, "__module__", None) != __name__:
        raise RuntimeError(f"AttentionInterface already has a function named {NAME!r} from {existing.__module__}; "
                           f"longdoc never overwrites a registered attention implementation")
    if existing is not kv_attention_forward:
        AttentionInterface.register(NAME, kv_attention_forward)


class KVSession:
    """A context-parallel KV-cache session over one batch of equal-length prompts (see the module docstring).

    All ranks of `cp` must make the same calls with the same token ids. Use as a context manager: entering
    switches the model to the session's attention, leaving restores it (and a longdoc.patch).
    """

    def __init__(self, model: torch.nn.Module, cp: ContextParallel, *, strategy: str = "ring"):
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a longdoc.ContextParallel, got {type(cp).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
        self.model, self.cp, self.hf = model, cp, hf_model(model)
        self.name = model_name(self.hf)
        check_config(self.hf.config, self.name)
        self.state = _State(cp, strategy, self.name)
        self.cache = ShardedCache()
        self.counts = [0] * cp.size  # cached tokens per rank: identical arithmetic on every rank
        self.length = 0  # global tokens so far
        self.batch = 0
        self._restore = None

    # ---- context management ----

    def __enter__(self) -> KVSession:
        hf = self.hf
        repatch = None
        if is_patched(hf):
            handle = hf._longdoc_cp
            repatch = (handle.cp, handle.strategy)
            unpatch(hf)
        register()
        original = hf.config._attn_implementation
        hf.set_attn_implementation(NAME)
        if hf.config._attn_implementation != NAME:
            raise cp_attn.refuse(self.name, "an attention implementation that cannot be switched",
                                 "load the model with attn_implementation='sdpa'")
        for m in hf.modules():
            m._longdoc_kv = self.state
        self._restore = (original, repatch)
        return self

    def __exit__(self, *exc) -> None:
        original, repatch = self._restore
        for m in self.hf.modules():
            m.__dict__.pop("_longdoc_kv", None)
        self.hf.set_attn_implementation(original)
        if repatch is not None:
            patch(self.model, repatch[0], strategy=repatch[1])
        self.state.mode = "idle"
        self._restore = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep) -> torch.Tensor:
        if self._restore is None:
            raise RuntimeError("use KVSession as a context manager: `with KVSession(model, cp) as s: ...`")
        with torch.no_grad():
            out = self.hf(input_ids=ids, position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1),
                          cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits.float()

    # ---- prefill / extend ----

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt (batch, len), identical on all ranks, through the model with CP; returns the
        logits after its last token, (batch, vocab) fp32, identical on all ranks."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        if self.length:
            raise RuntimeError("prefill starts a session; this one already holds tokens (use a new KVSession)")
        cp, seq = self.cp, ids.shape[1]
        self._agree_shapes("prefill", ids)
        if seq == 0:
            raise ValueError("prefill needs at least one prompt token")
        self._check_rope(seq)
        padded = layouts.round_up(seq, cp.multiple)
        full = torch.nn.functional.pad(ids, (0, padded - seq), value=0)  # pad ids never reach a real token
        positions = cp.positions(padded, device=ids.device)
        # The logits of the last prompt token: kept (computed) by the rank holding it only.
        holder = next(r for r in range(cp.size) if bool((layouts.positions(padded, r, cp.size, cp.layout)
                                                           == seq - 1).any()))
        mine = torch.nonzero(positions == seq - 1).flatten()
        keep = mine if cp.rank == holder else torch.zeros(1, dtype=torch.long, device=ids.device)
        self.state.mode, self.state.total, self.cache.append = "prefill", seq, True
        logits = self._forward(cp.shard(full, dim=1), positions, keep)[:, -1]
        self.cache.keep(torch.nonzero(positions < seq).flatten())  # drop the padding's K/V
        self.counts = [int((layouts.positions(padded, r, cp.size, cp.layout) < seq).sum()) for r in range(cp.size)]
        self.length, self.batch = seq, ids.shape[0]
        if cp.size > 1:
            logits = comm.all_gather(logits.contiguous(), cp.group, cp.timeout)[holder]
        return logits

    def extend(self, input_ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Append tokens (batch, new) after everything so far; returns the logits after each of the last
        `keep` of them, (batch, keep, vocab) fp32, identical on all ranks."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        self._agree_shapes("extend", ids)
        if not self.length:
            raise RuntimeError("call prefill before extend")
        if ids.shape[0] != self.batch:
            raise ValueError(f"extend got a batch of {ids.shape[0]}, the session holds {self.batch}")
        new = ids.shape[1]
        if not 1 <= keep <= new:
            raise ValueError(f"keep must be in [1, {new}] for {new} new tokens, got {keep}")
        self._check_rope(self.length + new)
        owner = min(range(self.cp.size), key=lambda r: (self.counts[r], r))
        positions = torch.arange(self.length, self.length + new, device=ids.device)
        self.state.mode, self.state.total = "extend", self.length + new
        self.state.appending = self.cache.append = owner == self.cp.rank
        try:
            logits = self._forward(ids, positions, keep)
        finally:
            self.cache.append = True
        self.counts[owner] += new
        self.length += new
        return logits

    def mark(self) -> tuple[int, ...]:
        """The session's position, for `rollback` (e.g. after the shared document, before each question)."""
        return (self.length, *self.counts)

    def rollback(self, mark: tuple[int, ...]) -> None:
        """Forget every token appended after `mark` (prefill tokens are never dropped)."""
        length, *counts = mark
        if length > self.length or any(c > now for c, now in zip(counts, self.counts)):
            raise ValueError(f"cannot roll back forward: mark {mark} is after the session's {self.mark()}")
        self.cache.truncate(counts[self.cp.rank])
        self.length, self.counts = length, list(counts)

    # ---- decoding ----

    def greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
               return_logits: bool = False) -> Generation:
        """Greedy decoding from `logits` (batch, vocab), the logits after the last token so far."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                           dtype=torch.long, device=logits.device)
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        last = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        tokens, seen = [], []
        for step in range(max_new_tokens):
            nxt = self._agree(logits.argmax(dim=-1))
            nxt = torch.where(finished, last, nxt)  # a finished row repeats its EOS
            tokens.append(nxt)
            if return_logits:
                seen.append(logits)
            finished |= torch.isin(nxt, eos)
            last = nxt
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self.extend(nxt.unsqueeze(1))[:, -1]
        return Generation(torch.stack(tokens, dim=1), torch.stack(seen, dim=1) if return_logits else None)

    def _agree(self, token: torch.Tensor) -> torch.Tensor:
        # Ranks compute the same logits, but a near-tie could still round differently on one of them:
        # rank 0 decides, so the caches never diverge.
        if self.cp.size == 1:
            return token
        return comm.all_gather(token.contiguous(), self.cp.group, self.cp.timeout)[0]

    def _agree_shapes(self, what: str, ids: torch.Tensor) -> None:
        """Before any collective of a call: all ranks pass the same shape at the same point, or all raise."""
        if self.cp.size == 1 or not self.cp.check_agreement:
            return
        mine = [*ids.shape, self.length]
        metas = comm.agree(mine, self.cp.group, self.cp.timeout, self.cp.comm_device(ids.device))
        if any(m != metas[0] for m in metas):
            detail = "; ".join(f"rank {r}: ids {tuple(m[:-1])} after {m[-1]} tokens" for r, m in enumerate(metas))
            raise ValueError(f"KVSession.{what}: CP ranks disagree ({detail}); every rank must make the same calls "
                             f"with the same token ids")

    def _check_rope(self, length: int) -> None:
        limit = rope_limit(self.hf.config)
        if limit is not None and length > limit[1]:
            raise cp_attn.refuse(self.name, f"RoPE scaling {limit[0]!r} at {length} tokens (beyond its "
                                 f"{limit[1]}-token threshold)", "it picks frequencies from the largest position "
                                 "each rank sees; use a static RoPE scaling or shorter inputs")


def generate(model: torch.nn.Module, cp: ContextParallel, input_ids: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | list[int] | None = None, strategy: str = "ring",
             return_logits: bool = False) -> Generation:
    """Greedy generation after a context-parallel prefill of `input_ids` (batch, len) (same on all ranks)."""
    with KVSession(model, cp, strategy=strategy) as session:
        logits = session.prefill(input_ids)
        return session.greedy(logits, max_new_tokens, eos_token_id, return_logits)
