"""The Hugging Face side of state passing: what a recurrent layer kind (longdoc.hf.kinds) needs per call.

    def routes(call: Call) -> dict:                                   # entry point -> fn(torch_fn, *args)
        return {"causal_conv1d_fn": call.conv, "mamba2_chunk_scan": ssd_route(call), ...}

    def cp_forward(module, handle, original, *args, **kwargs):          # a LayerKind's forward
        return forward(module, handle, original, args, kwargs, routes, required={"mamba2_chunk_scan", ...})

A transformers mixer calls module-level functions for its sequence mixing (causal_conv1d_fn, mamba2_chunk_scan,
mamba_selective_scan, ...: the entry points that mamba_ssm / causal_conv1d / hub kernels replace). `route`
swaps them, for the duration of one call of that mixer and on its thread only, for CP versions built on
longdoc.parallel.recurrent; everything else (projections, gates, norms, multipliers) is the model's own code.
The swapped-in functions call transformers' own pure-torch function (`__wrapped__`) on each piece, never a fused
kernel on sharded tokens. `hooks(module)` lists the entry points a mixer's code calls, so a kind refuses (by
name) a mixer that calls one it has no route for.

Modes (handle.mode): "train" (a patched forward: documents from the call's packed rows; any cache the model
built for itself is dropped, the CP outputs never need one), "prefill" (a KV session: the prompt padded to
cp.multiple, its state reset where the padding starts; the final state lands in the session's ShardedCache,
whose recurrent layers longdoc.hf.decode makes CP-aware), "extend" (decode: every rank runs the new tokens
itself through the module's own cached path).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longdoc.hf import attention as backend
from longdoc.parallel.recurrent import Segments, halo

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def prefill_segments(cp, total: int, padded: int) -> Segments:
    """A session prefill's row: `total` prompt tokens padded to `padded`; the state resets at the padding."""
    return Segments.of(cp.layout, cp.size, padded, resets=(total,))


@dataclass
class Call:
    """One call of a recurrent mixer under CP: the group, the rows' segments and the state to hand on."""

    module: torch.nn.Module
    handle: object
    cu: torch.Tensor | None = None  # the call's own cu_seq_lens_q (packed rows), if the model passed it down

    @classmethod
    def of(cls, module, handle, kwargs: dict) -> Call:
        return cls(module, handle, kwargs.get("cu_seq_lens_q"))

    @property
    def cp(self):
        return self.handle.cp if self.handle.session is None else self.handle.session.cp

    @property
    def final_at(self) -> int | None:
        """Where the state decoding continues from is (prefill: the prompt's end), else None."""
        session = self.handle.session
        return session.total if session is not None and session.mode == "prefill" else None

    def segments(self, bsz: int, local_len: int) -> Segments | list[Segments]:
        """The segments of this call's rows (one for all, or one per row when rows are packed differently)."""
        cp, session = self.cp, self.handle.session
        if session is not None:
            return prefill_segments(cp, session.total, local_len * cp.size)
        docs = backend._documents(self.handle, self.cu, bsz, local_len)
        if docs is None:
            return Segments.of(cp.layout, cp.size, local_len * cp.size)
        return [Segments.of(cp.layout, cp.size, d.seq_len, d) for d in docs]

    def conv(self, fn: Callable, x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """fn(x, weight, ...) for a causal depthwise conv over x (batch, channels, local_len) with a halo of
        kernel - 1 tokens per piece, so it equals the shard of fn over the full rows; weight (channels, kernel)."""
        n = weight.shape[-1] - 1
        segs = self.segments(x.shape[0], x.shape[-1])
        if isinstance(segs, Segments):
            ext, keep = halo(x, n, self.cp, segs, dim=-1)
            return fn(ext, weight, *args, **kwargs).index_select(-1, keep)
        # Rows packed differently: one halo per row (every rank loops alike).
        return torch.cat([self.conv_row(fn, x[b:b + 1], seg, weight, *args, **kwargs)
                          for b, seg in enumerate(segs)], dim=0)

    def conv_row(self, fn, x, seg, weight, *args, **kwargs):
        ext, keep = halo(x, weight.shape[-1] - 1, self.cp, seg, dim=-1)
        return fn(ext, weight, *args, **kwargs).index_select(-1, keep)


def forward(module, handle, original, args: tuple, kwargs: dict, routes: Callable[[Call], dict],
            required: frozenset[str]):
    """A recurrent kind's CP forward: decode steps run the module's own cached path (every rank runs the new
    tokens itself); otherwise the module's forward runs with its kernel entry points routed, and must have
    called every `required` one (a forward replaced by a fused kernel would not: refused, never silent)."""
    if handle.mode == "extend":
        return original(*args, **kwargs)
    call, used = Call.of(module, handle, kwargs), set()
    with route(module, routes(call), used):
        out = original(*args, **without_cache(handle, kwargs))
    missing = sorted(required - used)
    if missing:
        raise RuntimeError(f"longdoc.patch: {type(module).__name__} (in {handle.model_name}) did not call "
                           f"{', '.join(missing)}: its forward is not transformers' own (a fused kernel replaced "
                           f"it?), so its outputs on CP-sharded tokens are NOT exact; run without CP or without "
                           f"that kernel")
    return out


def without_cache(handle, kwargs: dict) -> dict:
    """A train-mode call without the cache the model may have built for itself (CP outputs never need one;
    its recurrent layers would otherwise store this rank's local state)."""
    if handle.session is not None:
        return kwargs
    return {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}


def torch_path(fn: Callable) -> Callable:
    """transformers' pure-torch function behind a kernel entry point (use_kernel_func_from_hub_with_fallback
    wraps it with functools.wraps), or `fn` itself when it is not wrapped."""
    return getattr(fn, "__wrapped__", fn)


def hooks(module: torch.nn.Module) -> set[str]:
    """Kernel entry points (module-level functions wrapping a torch fallback) that the mixer's class code calls."""
    namespace = vars(sys.modules[type(module).__module__])
    names: set[str] = set()
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("transformers."):
            continue
        for value in vars(cls).values():
            fn = inspect.unwrap(value) if callable(value) else None
            code = getattr(fn, "__code__", None)
            if code is not None:
                names.update(code.co_names)
    return {n for n in names if callable(namespace.get(n)) and hasattr(namespace[n], "__wrapped__")}


def unrouted(module: torch.nn.Module, routes: set[str]) -> tuple[str, str] | None:
    """(feature, fix) when the mixer calls a kernel entry point the kind has no CP route for."""
    missing = sorted(hooks(module) - routes)
    if missing:
        return (f"{type(module).__name__} calling {', '.join(missing)} (a fused-kernel entry point without a "
                f"context-parallel route)", "run this model without CP, or with a transformers version whose "
                "mixer longdoc knows")
    return None


def never(name: str) -> Callable:
    """A route for an entry point that must not run under CP (e.g. a one-token cached update in training)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(f"longdoc: {name} ran on CP-sharded tokens; it is a cached one-token update that only "
                           f"decoding runs (longdoc.hf.generate)")
    return refuse


def unfused(*args, **kwargs) -> None:
    """The route of a fully fused layer kernel (e.g. mamba_split_conv1d_scan_combined): None, as transformers'
    own torch fallback returns, so the mixer takes its unfused path, which is routed piece by piece."""
    return None


@contextlib.contextmanager
def route(module: torch.nn.Module, routes: dict[str, Callable], used: set[str] | None = None):
    """While the block runs: the module-level functions named in `routes` (in the mixer's module) are
    replaced, on this thread only, by routes[name](torch_fn, *args, **kwargs); other threads see the originals.
    The names of the routes that ran are added to `used`."""
    namespace = vars(sys.modules[type(module).__module__])
    owner = threading.get_ident()
    used = set() if used is None else used
    saved = {}
    for name, cp_fn in routes.items():
        if name not in namespace:
            continue
        original = namespace[name]

        def swapped(*args, _cp_fn=cp_fn, _original=original, _name=name, **kwargs):
            if threading.get_ident() != owner:
                return _original(*args, **kwargs)
            used.add(_name)
            return _cp_fn(torch_path(_original), *args, **kwargs)

        saved[name] = original
        namespace[name] = swapped
    try:
        yield
    finally:
        for name, original in saved.items():
            namespace[name] = original

