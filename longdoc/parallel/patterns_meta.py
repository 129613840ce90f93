"""The attention-pattern part of `longdoc.attention`'s per-rank metadata, and its checks.

`build` turns the user's pattern arguments into a `masks.Pattern` plus a list of ints that joins the
q/k/v metadata every rank agrees on before any data moves (api._validate); it never raises, so a
bad value on one rank becomes the same ValueError on every rank (`problem`) instead of a hang.
"""

from __future__ import annotations

import math
import struct
import zlib

import torch

from longdoc.parallel.layout import Branches, Packed
from longdoc.parallel.masks import Pattern

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NOT_INT = -(1 << 62)  # a window / chunk_size that is not an int at all
_ZERO = -(1 << 61)  # a window / chunk_size of 0 (0 itself means "None" in the metadata)


def _int_or(x) -> int:
    if x is None:
        return 0
    if isinstance(x, bool) or not isinstance(x, int):
        return _NOT_INT
    return x if x != 0 else _ZERO


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _selected_meta(q: torch.Tensor, selected) -> list[int]:
    """[flag, n]: flag 0 none, 1 valid, -1 not an integer tensor, -2 not (batch, local_len, n), -3 other device."""
    if selected is None:
        return [0, 0]
    if not isinstance(selected, torch.Tensor) or selected.dtype not in _INTS:
        return [-1, 0]
    if selected.dim() != 3 or tuple(selected.shape[:2]) != (q.shape[0], q.shape[2]):
        return [-2, 0]
    if selected.device != q.device:
        return [-3, 0]
    return [1, selected.shape[2]]


def _crc(ints) -> int:
    ints = list(ints)
    return zlib.crc32(struct.pack(f"<{len(ints)}q", *ints))


def _branches(branches, packed: Packed | None, seq_len: int) -> tuple[Branches | None, Packed | None, list[int]]:
    """(branches, the row's documents, [flag, pairs, crc, last end]): flag 0 none, 1 valid, -1 malformed spans,
    -2 a pair that is not one document of `packed`, -3 a pair past the row. Without documents, the pairs'."""
    if branches is None:
        return None, packed, [0, 0, 0, 0]
    try:
        made = branches if isinstance(branches, Branches) else Branches(branches)
    except (TypeError, ValueError):
        return None, packed, [-1, 0, 0, 0]
    meta = [1, len(made.spans), _crc(made.cuts()), made.end]
    if made.end > seq_len:
        return None, packed, [-3, *meta[1:]]
    if packed is None:
        return made, made.documents(seq_len), meta
    try:
        made.check(packed)
    except ValueError:
        return None, packed, [-2, *meta[1:]]
    return made, packed, meta


def build(q: torch.Tensor, window, chunk_size, softcap, sinks, documents,
          selected=None, branches=None, seq_len: int = 0) -> tuple[Pattern, list[int]]:
    """(pattern, metadata ints) for these arguments; invalid values are encoded, not raised.
    seq_len: the full length (branches without documents lay the row out by their pairs)."""
    meta = [_int_or(window), _int_or(chunk_size)]
    cap_ok = isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap) \
        and softcap > 0
    meta += [0, 0] if softcap is None else ([1, _float_bits(float(softcap))] if cap_ok else [-1, 0])
    if sinks is None:
        meta += [0, 0, 0, 0, 1]
    elif not isinstance(sinks, torch.Tensor):
        meta += [-1, 0, 0, 0, 1]
    else:
        meta += [1, sinks.dim(), sinks.shape[0] if sinks.dim() else 0,
                 _FLOATS.index(sinks.dtype) if sinks.dtype in _FLOATS else -1, int(sinks.device == q.device)]
    packed = None
    if documents is not None:
        try:
            packed = documents if isinstance(documents, Packed) else Packed(tuple(documents))
        except (TypeError, ValueError):
            packed = None
        if packed is None:
            meta += [-1, 0, 0, 0]
        else:
            meta += [1, len(packed.doc_lens), packed.seq_len, _crc(packed.doc_lens)]
    else:
        meta += [0, 0, 0, 0]
    meta += _selected_meta(q, selected)
    made, packed, branch_meta = _branches(branches, packed, seq_len)
    meta += branch_meta
    pattern = Pattern(True, window if meta[0] > 0 else None, chunk_size if meta[1] > 0 else None,
                      float(softcap) if cap_ok else None, packed, made)
    return pattern, meta


def has_documents(meta: list[int]) -> bool:
    return len(meta) > 9 and meta[9] == 1


def describe(meta: list[int]) -> str:
    parts = []
    if meta[0]:
        parts.append(f"window={meta[0]}")
    if meta[1]:
        parts.append(f"chunk_size={meta[1]}")
    if meta[2] == 1:
        parts.append(f"softcap={struct.unpack('<d', struct.pack('<q', meta[3]))[0]:g}")
    if meta[4] == 1:
        parts.append(f"sinks {meta[5]}-D ({meta[6]},)")
    if meta[9] == 1:
        parts.append(f"documents: {meta[10]} summing to {meta[11]} (crc {meta[12]:08x})")
    if len(meta) > 13 and meta[13] == 1:
        parts.append(f"selected keys: {meta[14]} per query")
    if len(meta) > 15 and meta[15] == 1:
        parts.append(f"branches: {meta[16]} pairs ending at {meta[18]} (crc {meta[17]:08x})")
    return ", ".join(parts) if parts else "no pattern"


def problem(meta: list[int], *, causal: bool, q_heads: int, seq_len: int, layout: str) -> str | None:
    """What is wrong with one rank's pattern arguments, or None. seq_len: the full length."""
    window, chunk = meta[0], meta[1]
    for name, val in (("window", window), ("chunk_size", chunk)):
        if val < 0:
            got = "" if val == _NOT_INT else f", got {0 if val == _ZERO else val}"
            return f"{name} must be an int >= 1 or None{got}"
    if window and not causal:
        return ("window needs causal=True: a sliding window looks back (query i sees keys i - window < j <= i); "
                "for bidirectional local attention pass causal=True per direction or documents=")
    if meta[2] < 0:
        return "softcap must be a positive finite number (scores become softcap * tanh(s / softcap)) or None"
    if meta[4] < 0:
        return "sinks must be a torch.Tensor of shape (q_heads,) or None"
    if meta[4] == 1:
        if meta[5] != 1 or meta[6] != q_heads:
            shape = f"a {meta[5]}-D tensor" + (f" of length {meta[6]}" if meta[5] == 1 else "")
            return f"sinks must have shape (q_heads,) = ({q_heads},), one logit per query head; got {shape}"
        if meta[7] < 0:
            return "sinks must be a float16, bfloat16, float32 or float64 tensor"
        if not meta[8]:
            return "sinks must be on the same device as q"
    if meta[9] < 0:
        return ("documents must be cp.pack(doc_lens), a longdoc Packed, or a sequence of positive ints (the "
                "lengths of the packed documents, in order)")
    if meta[9] == 1 and meta[11] != seq_len:
        return (f"documents sum to {meta[11]} tokens but the full sequence has {seq_len} (local length x CP "
                f"size); pass the lengths of every document of the row, padding included")
    flag = meta[13] if len(meta) > 13 else 0
    if flag < 0:
        what = {-1: "an integer tensor", -2: "of shape (batch, local_len, n): n GLOBAL key positions per local query",
                -3: "on the same device as q"}[flag]
        return f"selected must be {what} (entries < 0 are unused slots), or None"
    return _branches_problem(meta, causal, seq_len)


def _branches_problem(meta: list[int], causal: bool, seq_len: int) -> str | None:
    flag = meta[15] if len(meta) > 15 else 0
    if flag == 0:
        return None
    if flag == -1:
        return ("branches: spans must be a longdoc Branches or a sequence of (prompt_start, chosen_start, "
                "rejected_start, end) int tuples, one per pair, in row order, with prompt, chosen and rejected "
                "non-empty and pairs not overlapping")
    if flag == -3:
        return f"branches: the last pair ends at {meta[18]}, past the row's {seq_len} tokens (local length x CP size)"
    if flag == -2:
        return ("branches: a pair is not one document of the packed row given as documents=; pass "
                "documents=branches.documents(seq_len) (every pair one document), or no documents")
    refused = ((not causal, "branches need causal=True (each sibling looks back at the prompt and itself)"),
               (meta[0], "branches with a sliding window are not supported; drop window="),
               (meta[1], "branches with chunked attention are not supported; drop chunk_size="),
               (len(meta) > 13 and meta[13], "branches with selected keys (sparse indexed attention) are refused"))
    return next((why for on, why in refused if on), None)
