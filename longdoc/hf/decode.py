"""Decoding mathematics under context parallelism: the sharded KV cache, attention of new tokens over
every rank's cache shard, and the token choice (greedy or seeded sampling). No transformers registry and
no model handling here: longdoc.hf.attention dispatches to `extend_attention`, longdoc.hf.session runs
the calls.

How a decode step works (every rank runs the same calls, in lockstep):
  prefill   the prompt is padded to cp.multiple and sharded by cp's layout; attention is the exact CP
            attention, and each layer's cache keeps this rank's K/V (the padding's K/V are dropped after).
  extend    new tokens are computed on every rank (replicated: they are few), with their TRUE global
            positions for RoPE. Their K/V are appended on ONE rank, the one holding the fewest cached
            tokens (lowest rank on a tie); every rank derives the owner from the same counts. In each layer
            a rank attends the new queries to its cache shard (causally among the new tokens on the owner),
            giving a partial (out, lse); the small partials are all-gathered and merged by log-sum-exp in
            rank order, identically on every rank. A layer's pattern (sliding window, Llama 4 chunks,
            soft-capping) masks each cached key by its GLOBAL position, which the session tracks per
            rank; attention sinks are folded once into the merged result, after the all-gather.
  choose    greedy argmax, or a sample drawn by inverse CDF from a seeded generator; rank 0's choice is
            used by every rank (see longdoc.hf.session), so ranks never diverge on a rounding tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from longdoc.parallel import blocks, comm, kernels, selection
from longdoc.parallel.api import ContextParallel
from longdoc.parallel.recurrent import Segments, tail

__all__ = ["ShardedCache", "Sampler", "extend_attention", "cache_layers"]


class _PrefillConvState:
    """A recurrent cache layer in a KV session (recurrent layers: state replicated on every rank). In a CP
    prefill each rank sees only its tokens: the conv state it stores is the last `conv_kernel_size` inputs
    before the prompt's end, gathered from the ranks holding them (longdoc.parallel.recurrent.tail). The
    recurrent state needs nothing here: the mixer's CP scan already returns the prompt's final state."""

    def __init__(self, session, **kwargs):
        super().__init__(**kwargs)
        self.session = session

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          gathered: bool = False, **kwargs) -> torch.Tensor:
        """gathered=True: `conv_states` already is the whole prompt's last inputs (a kind that gathered them)."""
        session = self.session
        if session is None or session.mode != "prefill" or gathered:
            return super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)
        if conv_kernel_size is None:
            raise RuntimeError("KV session: a recurrent layer stored a conv state without its kernel size in a CP "
                               "prefill; its layer kind must store it itself")
        cp = session.cp
        seg = Segments.of(cp.layout, cp.size, conv_states.shape[-1] * cp.size, resets=(session.total,))
        last = tail(conv_states, conv_kernel_size, cp, seg, at=session.total)
        super().update_conv_state(last, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)
        return conv_states  # the conv itself runs on this rank's tokens, with its halo (longdoc.hf.recurrent)


class CPLinearAttentionLayer(_PrefillConvState, LinearAttentionLayer):
    pass


class CPHybridLayer(_PrefillConvState, LinearAttentionAndFullAttentionLayer):
    """A hybrid layer: its recurrent state replicated, its attention K/V sharded like every attention layer."""


_RECURRENT_TYPES = {"conv": CPLinearAttentionLayer, "linear_attention": CPLinearAttentionLayer,
                    "hybrid": CPHybridLayer, "hybrid_sliding": CPHybridLayer}


def cache_layers(config, session) -> list | None:
    """The session cache's layers for a model with recurrent layers (None for attention-only models): recurrent
    types get a CP-aware recurrent layer, layers without a cache a DummyLayer, every attention layer a plain
    DynamicLayer (never a sliding-window one: ShardedCache keeps every token, the masks apply windows)."""
    text = config.get_text_config(decoder=True)
    types, per_layer = get_layer_types_and_kwargs(text)
    if not set(types) & set(_RECURRENT_TYPES):
        return None
    out = []
    for t, kw in zip(types, per_layer):
        if t in _RECURRENT_TYPES:
            out.append(_RECURRENT_TYPES[t](session, number_of_states=kw.get("number_of_states", 1)))
        else:
            out.append(DummyLayer() if t == "dummy" else DynamicLayer())
    return out


def _has_kv(layer) -> bool:
    return getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None \
        and layer.keys.dim() == 4


class ShardedCache(DynamicCache):
    """A DynamicCache holding only this rank's tokens. While `append` is False (another rank owns the
    new tokens) `update` returns the cached shard without storing the new K/V. With `layers` (cache_layers:
    models with recurrent layers), recurrent layers hold the whole sequence's state on every rank. `index_keys`
    holds the DSA indexers' keys of the same tokens, (batch, local, dim) per layer (longdoc.hf.kinds.dsa writes
    them)."""

    def __init__(self, layers: list | None = None) -> None:
        if layers is None:
            super().__init__()  # no config: plain DynamicLayers, never a sliding-window layer that drops tokens
        else:
            Cache.__init__(self, layers=layers)  # DynamicCache builds its own layers from a config only
        self.append = True
        self.index_keys: dict[int, torch.Tensor] = {}
        self.branch = None  # longdoc.hf.branches.BranchState while branches decode: new K/V go there

    @property
    def recurrent(self) -> bool:
        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.layers)

    def snapshot(self) -> list:
        """Copies of every recurrent layer's states (the KV shards roll back by truncation instead)."""
        return [None if not isinstance(layer, LinearAttentionCacheLayerMixin) else
                ({i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                 {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
                 dict(layer.has_previous_state)) for layer in self.layers]

    def restore(self, snapshot: list) -> None:
        for layer, snap in zip(self.layers, snapshot):
            if snap is not None:
                conv, rec, previous = snap
                layer.conv_states.update({i: t.clone() for i, t in conv.items()})
                layer.recurrent_states.update({i: t.clone() for i, t in rec.items()})
                layer.has_previous_state.update(previous)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.branch is not None:  # the rows' own K/V beside the shared prompt's, which stays as it is
            self.branch.append(layer_idx, key_states, value_states)
            return self.layers[layer_idx].keys, self.layers[layer_idx].values
        if self.append:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        layer = self.layers[layer_idx]
        if not _has_kv(layer) or layer.keys.dim() != key_states.dim():
            return key_states[..., :0, :], value_states[..., :0, :]
        return layer.keys, layer.values

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the cached tokens at local `index` (1-D LongTensor), in every layer."""
        for layer in self.layers:
            if _has_kv(layer):
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))
        self.index_keys = {i: k.index_select(1, index.to(k.device)) for i, k in self.index_keys.items()}

    def truncate(self, length: int) -> None:
        """Keep the first `length` local tokens in every layer (undo appends)."""
        for layer in self.layers:
            if _has_kv(layer):
                layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
        self.index_keys = {i: k[:, :length] for i, k in self.index_keys.items()}


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             kernel: kernels.Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over one block of keys in the accumulator dtype; an empty block gives (0, -inf)."""
    acc = kernels._lse_dtype(q.dtype)
    if k.shape[2] == 0:
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:3], float("-inf"), dtype=acc)
    out, lse = kernel.forward(q, k.contiguous(), v.contiguous(), causal, scale)
    return out.to(acc), lse.to(acc)


_KEY_TILE = 8192  # cached keys per score tile in the masked path: memory stays bounded at any length


def _masked_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scale: float, pattern, selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (batch, q_heads, new, d) at global positions q_pos over keys k/v (batch, kv_heads,
    m, d) at global positions k_pos under the layer's causal window / chunk / soft-cap and, for sparse indexed
    attention, `selected` (batch, new, n) global key positions per query, in the accumulator dtype; a row
    that sees no key gives (0, -inf)."""
    acc = kernels.lse_dtype(q.dtype)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qg = q.to(acc).reshape(b, hkv, hq // hkv, n, d)  # (batch, kv_heads, group, new, head_dim)
    out = q.new_zeros((b, hkv, hq // hkv, n, v.shape[-1]), dtype=acc)
    lse = q.new_full((b, hkv, hq // hkv, n), float("-inf"), dtype=acc)
    for start in range(0, k.shape[2], _KEY_TILE):
        kt = k[:, :, start:start + _KEY_TILE].to(acc).unsqueeze(2)  # (batch, kv_heads, 1, tile, head_dim)
        vt = v[:, :, start:start + _KEY_TILE].to(acc).unsqueeze(2)
        kp = k_pos[start:start + _KEY_TILE].view(1, -1)
        qp = q_pos.view(-1, 1)
        hidden = kp > qp  # (new, tile)
        if pattern.window is not None:
            hidden |= kp <= qp - pattern.window
        if pattern.chunk_size is not None:
            hidden |= kp // pattern.chunk_size != qp // pattern.chunk_size
        if selected is not None:  # (batch, new, tile): keys the indexer did not select are hidden
            chosen = selection.visible(selected, kp.view(-1), int(q_pos.max()) + 1)
            hidden = (hidden | ~chosen)[:, None, None]  # (batch, 1, 1, new, tile) against s's heads
        s = torch.matmul(qg, kt.transpose(-1, -2)) * scale
        if pattern.softcap is not None:
            s = pattern.softcap * torch.tanh(s / pattern.softcap)
        s = s.masked_fill(hidden, float("-inf"))
        t_lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(t_lse), torch.full_like(t_lse, float("inf")), t_lse)
        t_out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), vt)  # seen-nothing rows: exp(-inf) = 0
        out, lse = blocks.merge(out, lse, t_out, t_lse)
    return out.reshape(b, hq, n, -1), lse.reshape(b, hq, n)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, scale: float,
                     appending: bool, pattern=None, start: int | None = None,
                     key_positions: torch.Tensor | None = None, selected: torch.Tensor | None = None) -> torch.Tensor:
    """New queries (replicated on every rank) over the keys of all ranks' cache shards.

    q (batch, q_heads, new, head_dim); k, v (batch, kv_heads, local, head_dim) this rank's shard, whose
    last `new` entries are the new tokens when `appending`. Returns (batch, q_heads, new, head_dim),
    identical on every rank. `pattern` (longdoc.hf.attention.LayerPattern) with a window, chunks or a
    soft-cap, or `selected` keys (sparse indexed attention: (batch, new, n) global key positions per new
    query), needs `start` (the global position of the first new token) and `key_positions` (global
    positions of this rank's cached tokens before this call); its sinks are folded in once at the end.
    """
    new = q.shape[2]
    old = k.shape[2] - new if appending else k.shape[2]
    masked = selected is not None or pattern is not None and (
        pattern.window is not None or pattern.chunk_size is not None or pattern.softcap is not None)
    if masked:
        q_pos = torch.arange(start, start + new, device=q.device)
        k_pos = key_positions.to(q.device) if key_positions is not None else q_pos[:0]
        if k_pos.numel() != old:
            raise RuntimeError(f"KV session: {k_pos.numel()} cached positions for {old} cached keys on this rank")
        if appending:
            k_pos = torch.cat([k_pos, q_pos])
        out, lse = _masked_partial(q, k, v, q_pos, k_pos, scale, pattern, selected)
    else:
        kernel = kernels.select(q.device, q.dtype, cp.kernel)
        # Every cached key precedes every new query: no mask. Among the new tokens (on the owner only) the
        # block is square and starts at the first new token, so top-left causal alignment is right.
        out, lse = _partial(q, k[:, :, :old], v[:, :, :old], False, scale, kernel)
        if appending:
            out, lse = blocks.merge(out, lse, *_partial(q, k[:, :, old:], v[:, :, old:], True, scale, kernel))
    if cp.size > 1:
        # One all-gather of (out | lse) per layer: new x head_dim numbers per head, tiny next to the cache.
        parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1), cp.group, cp.timeout, cp.guard,
                                "all_gather decode out|lse")
        out = torch.zeros_like(out)
        lse = torch.full_like(lse, float("-inf"))
        for part in parts:  # rank order on every rank: bit-identical results everywhere
            out, lse = blocks.merge(out, lse, part[..., :-1], part[..., -1])
    if pattern is not None and pattern.sinks is not None:
        out, lse = blocks.fold_sinks(out, lse, pattern.sinks.detach())
    return out.to(q.dtype)


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from (batch, vocab) logits; checked at construction.

    Sampling follows transformers' order (temperature, then top-k, then top-p) in float64, then draws by
    inverse CDF over the token ids in id order with one uniform number per row from `generator`: a
    rounding-level change of the logits (cp=2 vs cp=1) moves a CDF boundary by rounding only, so the same
    seed picks the same token unless the draw lands within ~1e-7 of a boundary.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """(batch,) token ids for (batch, vocab) logits."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        x = logits.double() / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1:
            ordered, idx = x.sort(dim=-1)  # ascending, like transformers' TopPLogitsWarper
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            drop[..., -1] = False  # always keep the most likely token
            x = x.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
        cdf = x.softmax(dim=-1).cumsum(dim=-1)
        u = torch.rand(x.shape[0], generator=generator, dtype=torch.float64)
        u = u.to(cdf.device).unsqueeze(-1) * cdf[..., -1:]
        # right=True: the first id whose CDF exceeds u, which always has a positive probability
        return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=x.shape[-1] - 1)
