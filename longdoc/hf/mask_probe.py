"""What mask a patched model MEANT each forward: its mask functions probed, so that an attention layer whose call
carries another pattern is refused by name instead of computed silently wrong.

Under CP the mask function (`attention.cp_mask`) builds nothing and each layer's attention reads its pattern from
the call (`sliding_window=`, the module's attribute, config.layer_types). A model may build a sliding-window mask
from its config yet never pass the window to its attention function (transformers' PhiMoE does: its eager and
sdpa paths see the window only through the mask). Then the CP core would compute full causal attention where
one process computes a window. Every mask function transformers builds in one forward is probed here at two
query positions from the row's global length on: a constant visible run of keys ending at the query is a window,
all earlier keys (or a run as long as the row) is full causal; anything else (padding, packed documents, chunks,
bidirectional overlays: functions that read tensors or depend on the position) is "unknown" and leaves the check
out, as do extend calls of a KV session, which build no mask of their own.
"""

from __future__ import annotations

import threading

import torch

_PROBE = 1 << 22  # default probe position: far beyond any window a config names (one 4M bool vector)
CAUSAL = "causal"

_active = threading.local()


def begin(handle) -> None:
    """A patched model's forward starts: its mask functions from here on are recorded on `handle`."""
    handle.masks_seen = []
    _active.handle = handle


def end(handle) -> None:
    if getattr(_active, "handle", None) is handle:
        _active.handle = None


def _visible(mask_function, q: int) -> torch.Tensor:
    kv = torch.arange(q + 2)
    zero = torch.zeros((), dtype=torch.long)
    return torch.as_tensor(mask_function(zero, zero, torch.tensor(q), kv)).to(torch.bool).reshape(-1)


def _freevar(fn, name: str):
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    return cells[names.index(name)].cell_contents if name in names else None


def _unpacked(mask_function):
    """The pattern under transformers' packed-sequence wrapping, and_masks(remap_positions_for_packed_sequence(
    pattern, position_ids), packed_sequence_mask_function(ids)), else `mask_function`. transformers wraps when the
    position_ids of a call without cache jump (a zigzag rank's own: 0..9 then 30..39 at cp=2), so without this one
    rank reads "unknown" where the others name the window, and refuses alone while they start the ring. Documents are
    longdoc's own business (from position_ids); the check here is only the window the pattern means."""
    parts = _freevar(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return mask_function
    remapped, packed = parts
    if "packed_sequence_mask_function" not in getattr(packed, "__qualname__", "") or \
            "remap_positions_for_packed_sequence" not in getattr(remapped, "__qualname__", ""):
        return mask_function
    inner = _freevar(remapped, "mask_function")
    return inner if callable(inner) else mask_function


def shape_of(mask_function, probe: int = _PROBE) -> str | int | None:
    """CAUSAL, a window (int: keys visible, the query's own included), or None when not one of those. Windows
    of `probe` keys or more read as CAUSAL (they hide nothing in a row of at most `probe` tokens)."""
    if not callable(mask_function):
        return None
    mask_function = _unpacked(mask_function)
    points = (probe, probe + probe // 3 + 1)
    try:
        runs = []
        for q in points:
            seen = _visible(mask_function, q)
            if seen.shape[0] != q + 2 or bool(seen[q + 1]) or not bool(seen[q]):
                return None  # not causal (a key after the query is visible, or the query's own is not)
            first = int(torch.nonzero(seen).min())
            if not bool(seen[first:q + 1].all()):
                return None
            runs.append(q + 1 - first)
    except Exception:  # noqa: BLE001 - a mask function that reads tensors (padding, documents) at other indices
        return None
    if runs[0] >= probe:
        return CAUSAL
    return runs[0] if runs[0] == runs[1] else None


def record(mask_function, kv_length: int) -> None:
    """Called by the mask interface function with this rank's `kv_length`: note the shape of the mask the model is
    building, probed at the global row length (KV-session extend calls are not judged, so not probed)."""
    handle = getattr(_active, "handle", None)
    if handle is None or getattr(handle, "masks_seen", None) is None:
        return
    session = handle.session
    if session is not None and session.mode == "extend":
        return
    cp = handle.cp if session is None else session.cp
    length = kv_length * (cp.size if cp is not None else 1)
    handle.masks_seen.append(shape_of(mask_function, max(length, 64)))


def _effective(shape, length: int):
    return CAUSAL if shape is None or shape == CAUSAL or shape >= length else shape


def _describe(shape) -> str:
    return "full causal" if shape == CAUSAL else f"sliding-window ({shape} tokens)"


def mismatch(handle, window: int | None, chunked: bool, length: int) -> tuple[str, str] | None:
    """(feature, fix) when this layer's pattern (its call's window over a global row of `length` tokens) is
    none of the masks its model built in this forward; None when it is one, or when the masks are unknown."""
    masks = getattr(handle, "masks_seen", None)
    if not masks or chunked or any(m is None for m in masks):
        return None
    meant = {_effective(m, length) for m in masks}
    layer = _effective(window, length)
    if layer in meant:
        return None
    return (f"{' and '.join(sorted(_describe(m) for m in meant))} masks that its attention calls do not carry: "
            f"they pass {_describe(layer)} to the attention function at {length} tokens (its eager and sdpa paths "
            f"see the window only through the mask, which CP does not build)",
            "run sequences no longer than the model's config.sliding_window, or set config.sliding_window = None "
            "if full causal attention is what you want")
