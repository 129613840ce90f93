"""Public context-parallel API: `ContextParallel` (group + layout) and `attention(...)`."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import torch
import torch.distributed as dist

from longdoc.parallel import batch as batches
from longdoc.parallel import comm, kernels, patterns_meta
from longdoc.parallel import layout as layouts
from longdoc.parallel.allgather import allgather_attention
from longdoc.parallel.ring import ring_attention

Strategy = Literal["ring", "allgather"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


def check_strategy(strategy: str) -> str:
    """The one place a CP strategy name is validated."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    return strategy


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
    """

    def __init__(self, group=None, layout: str = "zigzag", *, timeout: float | datetime.timedelta | None = None,
                 kernel: str | None = None, check_agreement: bool = True):
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
        self._ring = comm.Ring(group, self.timeout) if group is not None and self.size > 1 else None

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, rank={self.rank}, layout={self.layout!r})"

    @property
    def multiple(self) -> int:
        """Full sequence lengths must be a multiple of this (cp.shard_batch pads internally)."""
        return layouts.num_chunks(self.layout, self.size)

    def pack(self, doc_lens) -> layouts.Packed:
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

    def positions(self, seq_len: int, device: torch.device | str | None = None,
                  documents: layouts.Packed | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens for a full sequence of `seq_len` tokens."""
        if documents is not None:
            if documents.seq_len != seq_len:
                raise ValueError(f"documents sum to {documents.seq_len} tokens, not seq_len {seq_len}")
            return documents.positions(self.rank, self.size, self.layout, device=device)
        return layouts.positions(seq_len, self.rank, self.size, self.layout, device=device)

    def shard_batch(self, batch: dict, **kwargs) -> dict:
        """Full batch dict (input_ids, labels?, attention_mask?) -> this rank's local batch, after checking
        that every rank of the group holds the same batch (see longdoc.parallel.batch)."""
        return batches.shard_batch(batch, self, **kwargs)

    def comm_device(self, like: torch.device) -> torch.device:
        if self.group is not None and dist.get_backend(self.group) == dist.Backend.NCCL:
            return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: ContextParallel, dim: int, documents):
        ctx.cp, ctx.dim, ctx.documents = cp, dim, documents
        parts = comm.all_gather(x, cp.group, cp.timeout)
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
        return comm.reduce_scatter(parts, cp.group, cp.timeout), None, None, None


# ---- validation: a pure function of every rank's metadata, so every rank raises the same error ----

_DTYPE_IDS = {dt: i for i, dt in enumerate((torch.float16, torch.bfloat16, torch.float32, torch.float64))}


class _Dims(NamedTuple):
    ndim: int
    shape: tuple[int, int, int, int]  # (batch, heads, local_len, head_dim) when 4-D

    @classmethod
    def of(cls, t: torch.Tensor) -> _Dims:
        return cls(t.dim(), tuple((list(t.shape) + [0, 0, 0, 0])[:4]))


class _Meta(NamedTuple):
    """One rank's attention inputs, as every rank sees them (packs to a list of ints for comm.agree)."""

    q: _Dims
    k: _Dims
    v: _Dims
    dtypes: tuple[int, int, int]  # _DTYPE_IDS of q, k, v; -1 unsupported
    same_device: int
    causal: int
    strategy: int
    pattern: tuple[int, ...] = ()  # window, chunk, softcap, sinks, documents: see patterns_meta

    @classmethod
    def of(cls, q, k, v, causal: bool, strategy: str, pattern_meta: list[int] | None = None) -> _Meta:
        return cls(_Dims.of(q), _Dims.of(k), _Dims.of(v), tuple(_DTYPE_IDS.get(t.dtype, -1) for t in (q, k, v)),
                   int(q.device == k.device == v.device), int(causal), STRATEGIES.index(strategy),
                   tuple(pattern_meta or ()))

    def pack(self) -> list[int]:
        return [*(i for d in (self.q, self.k, self.v) for i in (d.ndim, *d.shape)), *self.dtypes,
                self.same_device, self.causal, self.strategy, *self.pattern]

    @classmethod
    def unpack(cls, ints: list[int]) -> _Meta:
        dims = [_Dims(ints[i], tuple(ints[i + 1:i + 5])) for i in (0, 5, 10)]
        return cls(*dims, tuple(ints[15:18]), *ints[18:21], tuple(ints[21:]))


def _describe(meta: _Meta) -> str:
    names = {i: str(dt).removeprefix("torch.") for dt, i in _DTYPE_IDS.items()}
    dt = [names.get(i, "unsupported") for i in meta.dtypes]
    text = (f"q {meta.q.shape} {dt[0]}, k {meta.k.shape} {dt[1]}, v {meta.v.shape} {dt[2]}, "
            f"causal={bool(meta.causal)}")
    return text + (", " + patterns_meta.describe(list(meta.pattern)) if meta.pattern else "")


def _problem(meta: _Meta, layout: str, world_size: int) -> str | None:
    """What is wrong with one rank's attention inputs, or None."""
    if meta.q.ndim != 4 or meta.k.ndim != 4 or meta.v.ndim != 4:
        return (f"q, k and v must be 4-D (batch, heads, local_len, head_dim); got {meta.q.ndim}-D, {meta.k.ndim}-D "
                f"and {meta.v.ndim}-D tensors (transpose (batch, len, heads, dim) inputs with .transpose(1, 2))")
    (bq, hq, lq, dq), (bk, hk, lk, dk), (bv, hv, lv, dv) = meta.q.shape, meta.k.shape, meta.v.shape
    if min(meta.dtypes) < 0:
        return "q, k and v must be float16, bfloat16, float32 or float64 tensors"
    if len(set(meta.dtypes)) != 1:
        return f"q, k and v must have one dtype; got {_describe(meta)} (cast them to q's dtype)"
    if not meta.same_device:
        return "q, k and v must be on the same device"
    if (bk, hk, lk, dk) != (bv, hv, lv, dv):
        return f"k and v must have the same shape; got {_describe(meta)}"
    if bq != bk or dq != dk:
        return f"q and k must share batch size and head_dim; got {_describe(meta)}"
    if hk == 0 or hq % hk:
        return (f"q_heads ({hq}) must be a multiple of kv_heads ({hk}) for grouped-query attention; "
                f"got {_describe(meta)}")
    if lq != lk:
        return (f"q and k/v must hold the same local tokens (self-attention over one sharded sequence); "
                f"got local lengths {lq} and {lk}")
    if lq == 0:
        return "the local sequence is empty: the full sequence must have at least one token per chunk"
    pattern_problem = patterns_meta.problem(list(meta.pattern), causal=bool(meta.causal), q_heads=hq,
                                            seq_len=lq * world_size, layout=layout)
    if pattern_problem:
        return pattern_problem
    chunks = len(layouts.chunk_ids(layout, 0, world_size))
    if lq % chunks and not patterns_meta.has_documents(list(meta.pattern)):
        return (f"local length {lq} must be divisible by {chunks} for the {layout} layout (a rank holds "
                f"{chunks} chunks); shard the full sequence with cp.shard, or cp.shard_batch, which pads")
    return None


def _validate(q, k, v, cp: ContextParallel, causal: bool, strategy: str,
              pattern_meta: list[int] | None = None) -> None:
    check_strategy(strategy)
    meta = _Meta.of(q, k, v, causal, strategy, pattern_meta)
    if cp.size == 1 or not cp.check_agreement:
        metas = [meta]
    else:
        metas = [_Meta.unpack(m) for m in comm.agree(meta.pack(), cp.group, cp.timeout, cp.comm_device(q.device))]
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
              documents: layouts.Packed | Sequence[int] | None = None) -> torch.Tensor:
    """Exact full-sequence attention computed on local shards.

    q (batch, q_heads, local_len, head_dim); k, v (batch, kv_heads, local_len, head_dim), each this
    rank's shard (cp.shard) of the full tensors. Returns this rank's shard of
    SDPA(q, k, v, is_causal=causal, scale=scale, enable_gqa=True) under the pattern below. Differentiable
    (w.r.t. q, k, v and sinks). strategy: "ring" (K/V rotate, O(local) memory) or "allgather".
    Patterns, in GLOBAL positions (query i, key j of the full sequence):
      window: int >= 1, query i sees key j when i - window < j <= i (Hugging Face's sliding window;
          needs causal=True). Windows longer than the sequence are plain causal attention.
      chunk_size: int >= 1, Llama 4 chunked attention: i // chunk_size == j // chunk_size (and j <= i if causal);
          with documents, counted from each document's start (each document as if run on its own).
      softcap: float > 0, scores s become softcap * tanh(s / softcap) before masking (Gemma 2).
      sinks: tensor (q_heads,), a learned logit per head in every row's softmax denominator (GPT-OSS);
          any float dtype; gets a gradient, this rank's share: summed over the CP group (as the gradient
          all-reduce does for every parameter) it is the full gradient.
      documents: a packed row, `cp.pack(doc_lens)` (or the list of document lengths, in order, summing
          to the full length, padding included), shared by every row of the batch: tokens attend only
          within their document. Shard such rows with `cp.shard(x, dim, documents=...)`: with the
          zigzag layout each document is zigzagged over the ranks (layout.Packed).
    Patterns combine (e.g. window + documents + sinks). Blocks a pattern hides are never computed.
    """
    pattern, pattern_meta = patterns_meta.build(q, window, chunk_size, softcap, sinks, documents)
    _validate(q, k, v, cp, causal, strategy, pattern_meta)
    pattern = dataclasses.replace(pattern, causal=bool(causal)).normalized(q.shape[2] * cp.size)
    scale = kernels.default_scale(q.shape[-1]) if scale is None else float(scale)
    capped = pattern.softcap is not None
    kernel = kernels.select(q.device, q.dtype, cp.kernel, softcap=capped)
    band_kernel = kernels.select(q.device, q.dtype, cp.kernel, band=True, softcap=capped)
    extra = {"pattern": pattern, "sinks": sinks, "band_kernel": band_kernel}
    if strategy == "ring":
        return ring_attention(q, k, v, cp._ring, cp.layout, pattern.causal, scale, kernel, **extra)
    group = cp.group if cp.size > 1 else None
    return allgather_attention(q, k, v, group, cp.timeout, cp.layout, pattern.causal, scale, kernel, **extra)
