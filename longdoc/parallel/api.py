"""Public context-parallel API: `ContextParallel` (group + layout, optionally factored for usp) and `attention(...)`."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from longdoc.parallel import batch as batches
from longdoc.parallel import comm, kernels, patterns_meta
from longdoc.parallel import layout as layouts
from longdoc.parallel import strategy as strategies
from longdoc.parallel.guard import Guard
from longdoc.parallel.inputs import _describe, _Meta, _problem
from longdoc.parallel.ulysses import Grid


def check_strategy(strategy: str, cp: ContextParallel | None = None) -> str:
    """`strategy` if it names a registered CP strategy (longdoc.parallel.strategy), else a ValueError listing them;
    with `cp`, also that the group is set up for it (usp: factored with ulysses_size)."""
    chosen = strategies.get(strategy)
    if cp is not None:
        chosen.heads_split(cp.size, cp.ulysses_size)
    return strategy


def _check_ulysses_size(ulysses_size, size: int) -> int | None:
    if ulysses_size is None:
        return None
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1 \
            or size % ulysses_size:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"ulysses_size must be a divisor of the CP group size {size} ({divisors}), got "
                         f"{ulysses_size!r}; the group is factored as ring_size x ulysses_size")
    return ulysses_size


class ContextParallel:
    """A context-parallel group and the layout of the sequence over its ranks.

    Args:
        group: a ProcessGroup, a 1-D DeviceMesh, or None for the default group (or a single process
            when torch.distributed is not initialized).
        layout: "zigzag" (balanced causal work, default) or "contiguous".
        timeout: seconds (or timedelta) any CP communication may wait before raising.
        kernel: force a block kernel by name (see longdoc.parallel.kernels.KERNELS); None selects.
        check_agreement: before exchanging data, check cheaply that all ranks pass the same
            shapes/dtypes (gloo would otherwise deliver garbage on a mismatch), and in shard_batch that
            they hold the same batch content (checksums).
        debug_collectives: before each collective on the group, check across it that every rank issues
            the same op (sequence number, tag, bytes; longdoc.parallel.guard). Off by default (no cost).
        ulysses_size: for strategy "usp", factor the group as ring_size x ulysses_size (mesh axes
            "cp_ring" x "cp_ulysses"): CP rank = ring_index * ulysses_size + ulysses_index, so each Ulysses
            group is ulysses_size consecutive ranks (inside a node) and the ring runs across them. A divisor
            of the group size; creating it is collective over the group (every rank, same value). None: the
            group is not factored ("ring", "allgather" and "ulysses" need no factoring).

    The group carries CP traffic only. Under DDP/FSDP, do not pass the group gradients are reduced on
    (by default the world group): pass a group of its own, e.g. `dist.new_group()` (see longdoc.patch).
    """

    def __init__(self, group: dist.ProcessGroup | DeviceMesh | None = None, layout: str = "zigzag", *,
                 timeout: float | datetime.timedelta | None = None, kernel: str | None = None,
                 check_agreement: bool = True, debug_collectives: bool = False,
                 ulysses_size: int | None = None) -> None:
        self.layout = layouts.check_layout(layout)
        if kernel is not None:
            kernels.select(torch.device("cpu"), torch.float32, kernel)  # validates the name
        self.kernel = kernel
        self.check_agreement = check_agreement
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        if group is not None and hasattr(group, "get_group"):  # DeviceMesh
            if group.ndim != 1:
                raise ValueError(f"pass the 1-D 'cp' sub-mesh (mesh['cp']), got a {group.ndim}-D DeviceMesh")
            group = group.get_group()
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        if group is None:
            self.size, self.rank = 1, 0
        else:
            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.guard = Guard(group, "cp", self.timeout) if debug_collectives and self.size > 1 else None
        self._ring = comm.Ring(group, self.timeout, self.guard) if group is not None and self.size > 1 else None
        self.ulysses_size = _check_ulysses_size(ulysses_size, self.size)
        self._ulysses_group, self._outer_ring, self._ulysses_guard = self._factor(debug_collectives)

    def __repr__(self) -> str:
        factored = "" if self.ulysses_size is None else \
            f", ring_size={self.ring_size}, ulysses_size={self.ulysses_size}"
        return f"ContextParallel(size={self.size}, rank={self.rank}, layout={self.layout!r}{factored})"

    @property
    def ring_size(self) -> int | None:
        """The "cp_ring" axis of a group factored for usp (size // ulysses_size), else None."""
        return None if self.ulysses_size is None else self.size // self.ulysses_size

    def _factor(self, debug_collectives: bool = False):
        """The Ulysses group and the outer Ring of a factored group (None where an axis is trivial or the group
        is not factored). Only the group's members take part (use_local_synchronization), each creating its
        "cp_ulysses" group first and its "cp_ring" group second: the same order everywhere, so no deadlock."""
        u = self.ulysses_size
        if u is None or u in (1, self.size):
            return None, None, None
        if self.check_agreement:
            sizes = [m[0] for m in comm.agree([u], self.group, self.timeout, self.comm_device(torch.device("cpu")))]
            if len(set(sizes)) != 1:
                raise ValueError(f"ContextParallel: CP ranks disagree on ulysses_size ({sizes}, by rank); pass the "
                                 f"same value on every rank")
        world = dist.get_process_group_ranks(self.group)  # global ranks, in CP rank order
        ring_index, ulysses_index = divmod(self.rank, u)
        made = []
        for axis, members, want in (("cp_ulysses", [world[ring_index * u + i] for i in range(u)], ulysses_index),
                                    ("cp_ring", [world[i * u + ulysses_index] for i in range(self.size // u)],
                                     ring_index)):
            group = dist.new_group(members, timeout=self.timeout, use_local_synchronization=True,
                                   group_desc=f"longdoc_{axis}")
            if dist.get_rank(group) != want:  # new_group orders by global rank; CP rank order must agree
                raise RuntimeError(f"ContextParallel: the {axis} group {members} does not keep CP rank order "
                                   f"(CP groups from longdoc's meshes always do); build the CP group with global "
                                   f"ranks increasing in CP rank")
            made.append(group)
        guards = [Guard(g, axis, self.timeout) if debug_collectives else None
                  for g, axis in zip(made, ("cp_ulysses", "cp_ring"), strict=True)]
        return made[0], comm.Ring(made[1], self.timeout, guards[1]), guards[0]

    def _grid(self, width: int) -> Grid:
        """Where this rank sits for a Ulysses group of `width` ranks: the whole group, single ranks, or the group's
        own factoring (ulysses_size)."""
        if width == self.size:
            return Grid(self.group if self.size > 1 else None, self.rank, self.size, None, 0, 1, self.layout,
                        self.timeout, self.guard)
        ring_index, ulysses_index = divmod(self.rank, width)
        group = None if width == 1 else self._ulysses_group
        ring = self._ring if width == 1 else self._outer_ring
        guard = None if width == 1 else self._ulysses_guard
        return Grid(group, ulysses_index, width, ring, ring_index, self.size // width, self.layout, self.timeout,
                    guard)

    @property
    def multiple(self) -> int:
        """Full sequence lengths must be a multiple of this (cp.shard_batch pads internally)."""
        return layouts.num_chunks(self.layout, self.size)

    def pack(self, doc_lens: Sequence[int] | layouts.Packed) -> layouts.Packed:
        """A packed row of documents with these lengths (in order) for `attention(..., documents=)`
        and `shard/gather/positions(..., documents=)`; raises if the row length is not a multiple of
        cp.size (pad with `Packed.pad_to(cp.size)`)."""
        packed = doc_lens if isinstance(doc_lens, layouts.Packed) else layouts.Packed(tuple(doc_lens))
        packed.check(self.size)
        return packed

    def shard(self, x: torch.Tensor, dim: int = 1, documents: layouts.Packed | None = None) -> torch.Tensor:
        """This rank's part of the full tensor `x` (identical on all ranks) along `dim`.
        With `documents` (a packed row, cp.pack) the zigzag layout is per document."""
        if documents is not None:
            return documents.shard(x, dim, self.rank, self.size, self.layout)
        return layouts.shard(x, dim, self.rank, self.size, self.layout)

    def gather(self, x_local: torch.Tensor, dim: int = 1, documents: layouts.Packed | None = None) -> torch.Tensor:
        """The full tensor on every rank; inverse of `shard`. Differentiable: the gradient of the
        local part is the sum over ranks of their gradients for it (like all_gather's autograd)."""
        if self.size == 1:
            return x_local
        return _Gather.apply(x_local, self, dim, documents)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (same shape everywhere), on every rank. Differentiable: the gradient of
        each rank's `x` is the sum of all ranks' gradients of the result, so a function of the group's total that
        every rank takes a 1/cp.size share of gets, summed over the group, its full gradient (e.g. statistics
        over the whole sequence, such as an MoE router's load-balancing terms)."""
        if self.size == 1:
            return x
        return _Sum.apply(x, self)

    def positions(self, seq_len: int, device: torch.device | str | None = None,
                  documents: layouts.Packed | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens for a full sequence of `seq_len` tokens."""
        if documents is not None:
            if documents.seq_len != seq_len:
                raise ValueError(f"documents sum to {documents.seq_len} tokens, not seq_len {seq_len}")
            return documents.positions(self.rank, self.size, self.layout, device=device)
        return layouts.positions(seq_len, self.rank, self.size, self.layout, device=device)

    def shard_batch(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, torch.Tensor]:
        """Full batch dict (input_ids, labels?, attention_mask?) -> this rank's local batch, after checking
        that every rank of the group holds the same batch (see longdoc.parallel.batch)."""
        return batches.shard_batch(batch, self, **kwargs)

    def comm_device(self, like: torch.device) -> torch.device:
        if self.group is not None and dist.get_backend(self.group) == dist.Backend.NCCL:
            return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        return comm.all_reduce(x.clone(), cp.group, cp.timeout, cp.guard, "all_reduce cp.sum")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.clone(), ctx.cp.group, ctx.cp.timeout, ctx.cp.guard, "all_reduce cp.sum grad"), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel, dim: int, documents):
        ctx.cp, ctx.dim, ctx.documents = cp, dim, documents
        parts = comm.all_gather(x, cp.group, cp.timeout, cp.guard, "all_gather cp.gather")
        if documents is not None:
            return documents.unshard(parts, dim % x.dim(), cp.layout)
        return layouts.unshard(parts, dim % x.dim(), cp.layout)

    @staticmethod
    def backward(ctx, grad):
        cp, dim, docs = ctx.cp, ctx.dim % grad.dim(), ctx.documents
        if docs is not None:
            parts = [docs.shard(grad, dim, r, cp.size, cp.layout) for r in range(cp.size)]
        else:
            parts = [layouts.shard(grad, dim, r, cp.size, cp.layout) for r in range(cp.size)]
        return comm.reduce_scatter(parts, cp.group, cp.timeout, cp.guard, "reduce_scatter cp.gather"), None, None, None


# ---- validation: a pure function of every rank's metadata, so every rank raises the same error ----

def _validate(q, k, v, cp: ContextParallel, causal: bool, strategy: str,
              pattern_meta: list[int] | None = None) -> None:
    width = strategies.get(strategy).heads_split(cp.size, cp.ulysses_size)
    meta = _Meta.of(q, k, v, causal, strategy, width, pattern_meta)
    if cp.size == 1 or not cp.check_agreement:
        metas = [meta]
    else:
        metas = [_Meta.unpack(m) for m in comm.agree(meta.pack(), cp.group, cp.timeout, cp.comm_device(q.device),
                                                     cp.guard, "agree attention inputs")]
    for rank, m in enumerate(metas):
        problem = _problem(m, cp.layout, cp.size)
        if problem:
            raise ValueError(f"longdoc.attention: {problem}" + (f" [on CP rank {rank}]" if cp.size > 1 else ""))
    if any(m != metas[0] for m in metas):
        detail = "; ".join(f"rank {r}: {_describe(m)}" for r, m in enumerate(metas))
        raise ValueError(f"longdoc.attention: CP ranks disagree on attention inputs ({detail}); every rank "
                         f"must pass the same shapes, dtypes, flags and pattern (shard one full tensor with "
                         f"cp.shard)")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, causal: bool = True,
              scale: float | None = None, strategy: str = "ring", *, window: int | None = None,
              chunk_size: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
              documents: layouts.Packed | Sequence[int] | None = None,
              selected: torch.Tensor | None = None,
              branches: layouts.Branches | Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Exact full-sequence attention computed on local shards: this rank's shard of
    SDPA(q, k, v, is_causal=causal, scale=scale, enable_gqa=True) under the pattern below. Differentiable (w.r.t.
    q, k, v and sinks).

    Args:
        q: `[B, H, T_local, D]`, this rank's shard (cp.shard along dim 2) of the full queries.
        k: `[B, H_kv, T_local, D]`, its shard of the keys (H a multiple of H_kv); v the same shape.
        cp: the ContextParallel group and layout the shards were made with.
        causal: query i sees key j <= i only.
        scale: the softmax scale (None: 1 / sqrt(D)).
        strategy: a registered strategy (longdoc.parallel.strategy.names()): "ring" (K/V rotate, O(local)
            memory), "allgather" (K/V gathered), "ulysses" (heads all-to-all: every rank attends over the full
            sequence for its share of the heads; needs H >= cp.size) or "usp" (Ulysses inside groups of
            cp.ulysses_size consecutive ranks, ring across them; see longdoc.parallel.ulysses for the trade-offs).
        window: int >= 1, query i sees key j when i - window < j <= i (Hugging Face's sliding window; needs
            causal=True). Windows longer than the sequence are plain causal attention.
        chunk_size: int >= 1, Llama 4 chunked attention: i // chunk_size == j // chunk_size (and j <= i if causal);
            with documents, counted from each document's start (each document as if run on its own).
        softcap: float > 0, scores s become softcap * tanh(s / softcap) before masking (Gemma 2).
        sinks: `[H]`, a learned logit per head in every row's softmax denominator (GPT-OSS); any float dtype; gets
            a gradient, this rank's share: summed over the CP group (as the gradient all-reduce does for every
            parameter) it is the full gradient.
        documents: a packed row, `cp.pack(doc_lens)` (or the list of document lengths, in order, summing to the
            full length, padding included), shared by every row of the batch: tokens attend only within their
            document. Shard such rows with `cp.shard(x, dim, documents=...)`: with the zigzag layout each document
            is zigzagged over the ranks (layout.Packed).
        selected: `[B, T_local, n]` integers, for every LOCAL query n GLOBAL key positions (entries < 0 are unused
            slots): query i sees key j only if j is in selected[:, i] (and the rest of the pattern shows it).
            Sparse indexed attention (DeepSeek DSA) passes its indexer's top-k here; no gradient flows to it. Tiles
            of a block that no query selected a key of are skipped (longdoc/parallel/selection.py). Strategies
            with the heads all-to-all refuse it.
        branches: preference pairs packed as [prompt | chosen | rejected] (layout.Branches, or its spans: one
            (prompt_start, chosen_start, rejected_start, end) per pair, full-row indices), shared by every row of the
            batch: each pair is a document, chosen and rejected both see the prompt, rejected never sees chosen.
            Without `documents` the row's documents are `branches.documents(full_len)`: shard with
            `cp.shard(x, dim, documents=branches.documents(full_len))`. Needs causal=True; refused with window,
            chunk_size and selected.

    Returns:
        `[B, H, T_local, D]`, this rank's shard of the output, in q's dtype.

    Positions in the patterns are GLOBAL (query i, key j of the full sequence). Patterns combine (e.g. window +
    documents + sinks). Blocks a pattern hides are never computed.
    """
    chosen = strategies.get(strategy)
    if selected is not None and not chosen.selects_keys:  # the same on every rank: before any collective
        able = " or ".join(repr(n) for n in strategies.names() if strategies.get(n).selects_keys)
        raise ValueError(f"longdoc.attention: selected-key (sparse indexed) attention runs with strategy {able}, "
                         f"not {strategy!r}; use one of those for DSA models")
    pattern, pattern_meta = patterns_meta.build(q, window, chunk_size, softcap, sinks, documents, selected, branches,
                                                q.shape[2] * cp.size if q.dim() == 4 else 0)
    _validate(q, k, v, cp, causal, strategy, pattern_meta)
    pattern = dataclasses.replace(pattern, causal=bool(causal)).normalized(q.shape[2] * cp.size)
    scale = kernels.default_scale(q.shape[-1]) if scale is None else float(scale)
    capped = pattern.softcap is not None
    kernel = kernels.select(q.device, q.dtype, cp.kernel, softcap=capped)
    band_kernel = kernels.select(q.device, q.dtype, cp.kernel, band=True, softcap=capped)
    extra = {"pattern": pattern, "sinks": sinks, "band_kernel": band_kernel,
             "selected": selected.detach() if selected is not None else None}
    return chosen.attend(q, k, v, cp, pattern.causal, scale, kernel, **extra)
