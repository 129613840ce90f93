"""One rank's attention inputs as every rank checks them: the packed metadata that
`longdoc.attention` agrees on across the CP group before any data moves, and what is wrong with it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from longdoc.parallel import layout as layouts
from longdoc.parallel import patterns_meta
from longdoc.parallel import strategy as registry

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
    ulysses: int  # ranks that split the heads (1 for ring / allgather): a factoring every rank must share
    pattern: tuple[int, ...] = ()  # window, chunk, softcap, sinks, documents: see patterns_meta

    @classmethod
    def of(cls, q, k, v, causal: bool, strategy: str, ulysses: int = 1,
           pattern_meta: list[int] | None = None) -> _Meta:
        return cls(_Dims.of(q), _Dims.of(k), _Dims.of(v), tuple(_DTYPE_IDS.get(t.dtype, -1) for t in (q, k, v)),
                   int(q.device == k.device == v.device), int(causal), registry.names().index(strategy), ulysses,
                   tuple(pattern_meta or ()))

    def pack(self) -> list[int]:
        return [*(i for d in (self.q, self.k, self.v) for i in (d.ndim, *d.shape)), *self.dtypes,
                self.same_device, self.causal, self.strategy, self.ulysses, *self.pattern]

    @classmethod
    def unpack(cls, ints: list[int]) -> _Meta:
        dims = [_Dims(ints[i], tuple(ints[i + 1:i + 5])) for i in (0, 5, 10)]
        return cls(*dims, tuple(ints[15:18]), *ints[18:22], tuple(ints[22:]))


def _describe(meta: _Meta) -> str:
    names = {i: str(dt).removeprefix("torch.") for dt, i in _DTYPE_IDS.items()}
    dt = [names.get(i, "unsupported") for i in meta.dtypes]
    strategy = registry.names()[meta.strategy] + (f" over {meta.ulysses} Ulysses ranks" if meta.ulysses > 1 else "")
    text = (f"q {meta.q.shape} {dt[0]}, k {meta.k.shape} {dt[1]}, v {meta.v.shape} {dt[2]}, "
            f"causal={bool(meta.causal)}, strategy {strategy}")
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
    if hq < meta.ulysses:
        name = registry.names()[meta.strategy]
        return (f"strategy {name!r} splits the query heads over {meta.ulysses} ranks, but there are only {hq}; use "
                f"strategy='usp' with ulysses_size <= {hq} (ContextParallel(group, ulysses_size=...)), or 'ring'")
    pattern_problem = patterns_meta.problem(list(meta.pattern), causal=bool(meta.causal), q_heads=hq,
                                            seq_len=lq * world_size, layout=layout)
    if pattern_problem:
        return pattern_problem
    chunks = len(layouts.chunk_ids(layout, 0, world_size))
    if lq % chunks and not patterns_meta.has_documents(list(meta.pattern)):
        return (f"local length {lq} must be divisible by {chunks} for the {layout} layout (a rank holds "
                f"{chunks} chunks); shard the full sequence with cp.shard, or cp.shard_batch, which pads")
    return None
