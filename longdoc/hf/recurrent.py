"""The Hugging Face side of state passing: what a recurrent layer kind (longdoc.hf.kinds) needs per call.

    def routes(call: Call) -> dict:                                   # entry point -> fn(torch_fn, *args)
        return {"causal_conv1d_fn": call.conv, "mamba2_chunk_scan": ssd_route(call), ...}

    register(Routed(name="mamba2", classes=..., routes=routes,          # longdoc.hf.kinds.registry: its forward
                    routed={"causal_conv1d_fn", "mamba2_chunk_scan", ...},      # is `forward` below, its
                    required={"causal_conv1d_fn", "mamba2_chunk_scan"}))         # refusal `unrouted`

A transformers mixer calls module-level functions for its sequence mixing (causal_conv1d_fn, mamba2_chunk_scan,
mamba_selective_scan, ...: the entry points that mamba_ssm / causal_conv1d / hub kernels replace). `route`
swaps them, for the duration of one call of that mixer and on its thread only, for CP versions built on
longdoc.parallel.recurrent; everything else (projections, gates, norms, multipliers) is the model's own code.
The swapped-in functions call transformers' own pure-torch function (`torch_path`) on each piece, never a fused
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
from longdoc.parallel.recurrent import Segments, by_row, halo

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")

# transformers >= 5.25: hub-replaceable wrappers around a mixer's conv and scan, which read and write the cache and
# call the routed kernel entry points inside. Under CP each runs as its own torch function (`through`), so the entry
# points it calls are routed, and a hub kernel that replaces the whole wrapper never runs on sharded tokens.
PASS_THROUGH = frozenset({"causal_conv1d_forward", "mamba2_scan_forward", "mamba_scan_forward"})


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
        docs = backend.call_documents(self.handle, self.cu, bsz, local_len)
        if docs is None:
            return Segments.of(cp.layout, cp.size, local_len * cp.size)
        return [Segments.of(cp.layout, cp.size, d.seq_len, d) for d in docs]

    def conv(self, fn: Callable, x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """fn(x, weight, ...) for a causal depthwise conv over x (batch, channels, local_len) with a halo of
        kernel - 1 tokens per piece, so it equals the shard of fn over the full rows; weight (channels, kernel)."""
        n = weight.shape[-1] - 1
        outs = []
        for rows, seg in by_row(self.segments(x.shape[0], x.shape[-1]), x.shape[0]):
            ext, keep = halo(x[rows], n, self.cp, seg, dim=-1)
            outs.append(fn(ext, weight, *args, **kwargs).index_select(-1, keep))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def forward(module, handle, original, args: tuple, kwargs: dict, routes: Callable[[Call], dict],
            required: frozenset[str]):
    """A recurrent kind's CP forward: decode steps run the module's own cached path (every rank runs the new
    tokens itself); otherwise the module's forward runs with its kernel entry points routed, and must have
    called every `required` one (a forward replaced by a fused kernel would not: refused, never silent)."""
    if handle.mode == "extend":
        return original(*args, **kwargs)
    call, used = Call.of(module, handle, kwargs), set()
    with route(module, {**dict.fromkeys(PASS_THROUGH, through), **routes(call)}, used):
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
    """transformers' pure-torch function behind a kernel entry point, or `fn` itself when it is no entry point.

    transformers wraps each entry point with use_kernel_func_from_hub_with_fallback: a function that dispatches to
    a fused package (mamba_ssm, causal_conv1d, fla) when one is installed, made with functools.wraps, so the torch
    function is its `__wrapped__` (transformers <= 5.24, without the `kernels` package). With `kernels` installed
    (a dependency of transformers >= 5.25) that function is further turned into an instance of a `Func`
    nn.Module whose class forward calls it (kernels' _create_func_module), so the torch function sits one level
    deeper; 5.25 also has entry points that only a hub kernel may replace (use_kernel_forward_from_hub on the torch
    function itself, e.g. mamba2's causal_conv1d_forward), whose Func calls the torch function directly. An
    object that looks like such a wrapper but whose torch function cannot be found raises: calling it would run
    a fused kernel on CP-sharded tokens."""
    inner = _kernel_func(fn)
    if inner is None:
        return fn
    return getattr(inner, "__wrapped__", inner)


def is_entry_point(value: object) -> bool:
    """Whether a module-level object is a kernel entry point (see `torch_path`)."""
    return _kernel_func(value) is not None


def _kernel_func(value: object) -> Callable | None:
    """The function a kernel entry point calls when no hub kernel replaces it (a dispatcher carrying
    `__wrapped__`, or, for a function only a hub kernel may replace, the torch function itself), or None."""
    if isinstance(value, torch.nn.Module):
        if type(value).__name__ != "Func" or "_create_func_module" not in type(value).__qualname__:
            return None
        forward = type(value).__dict__.get("forward")
        func = inspect.getclosurevars(forward).nonlocals.get("func") if forward is not None else None
        if not inspect.isfunction(func):
            raise EntryPointError(f"a kernels Func entry point ({type(value).__qualname__}) whose torch function "
                                  f"longdoc cannot find (its forward no longer closes over a function `func`): the "
                                  f"`kernels` package changed how it wraps functions; pin the versions in "
                                  f"constraints.txt")
        return func
    if inspect.isfunction(value) and hasattr(value, "__wrapped__"):
        return value
    return None


class EntryPointError(RuntimeError):
    """Kernel entry-point discovery no longer understands how transformers wraps its torch functions."""


def referenced(module: torch.nn.Module) -> set[str]:
    """Global names that the mixer's transformers class code (its methods, through every base) refers to, and
    those that the torch functions of the PASS_THROUGH wrappers it calls refer to (they run under CP too)."""
    codes = []
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("transformers."):
            continue
        for value in vars(cls).values():
            fn = inspect.unwrap(value) if callable(value) else None
            codes.append(getattr(fn, "__code__", None))
    namespace = vars(sys.modules[type(module).__module__])
    names: set[str] = set()
    while codes:
        code = codes.pop()
        if code is None:
            continue
        for name in set(code.co_names) - names:
            names.add(name)
            if name in PASS_THROUGH and name in namespace:
                codes.append(getattr(torch_path(namespace[name]), "__code__", None))
    return names


def hooks(module: torch.nn.Module) -> set[str]:
    """Kernel entry points (module-level functions wrapping a torch fallback) that the mixer's class code calls."""
    namespace = vars(sys.modules[type(module).__module__])
    return {n for n in referenced(module) if n in namespace and is_entry_point(namespace[n])}


def unrouted(module: torch.nn.Module, routes: set[str]) -> tuple[str, str] | None:
    """(feature, fix) when the mixer calls a kernel entry point the kind has no CP route for.

    Raises EntryPointError when the discovery is blind: a routed name that the mixer's code calls is not
    recognised as an entry point, so an unrouted one would not be either (a guard that goes blind fails loudly)."""
    found, routes = hooks(module), routes | PASS_THROUGH
    namespace = vars(sys.modules[type(module).__module__])
    blind = sorted(n for n in routes & referenced(module) if n in namespace and n not in found)
    if blind:
        raise EntryPointError(f"longdoc cannot recognise {', '.join(blind)} in {type(module).__module__} as kernel "
                              f"entry points (transformers changed how it wraps them?), so it cannot tell whether "
                              f"{type(module).__name__} calls one it does not route; pin the versions in "
                              f"constraints.txt")
    missing = sorted(found - routes)
    if missing:
        return (f"{type(module).__name__} calling {', '.join(missing)} (a fused-kernel entry point without a "
                f"context-parallel route)", "run this model without CP, or with a transformers version whose "
                "mixer longdoc knows")
    return None


def through(fn: Callable, *args, **kwargs):
    """The route of a wrapper entry point (PASS_THROUGH): its own torch function, whose inner calls are routed."""
    return fn(*args, **kwargs)


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

