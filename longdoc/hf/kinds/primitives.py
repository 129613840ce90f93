"""Small helpers of the recurrent kinds beyond longdoc.hf.recurrent's routes: shadowing a method or a submodule's
forward on one instance for one call (RecurrentGemma's `_rnn_scan` and `conv_1d`, RWKV's `time_shift`), the
one-token time shift with its halo, and recognising a state handed in that is only the model's fresh start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from longdoc.parallel.recurrent import Segments, by_row, halo, tail

_MISSING = object()


@contextlib.contextmanager
def shadowed(module: torch.nn.Module, **attributes) -> Iterator[None]:
    """Instance attributes of `module` (shadowing e.g. a method or `forward`) for the duration of the block."""
    old = {name: module.__dict__.get(name, _MISSING) for name in attributes}
    try:
        for name, value in attributes.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in old.items():
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)


def shift(x: torch.Tensor, cp, segs: Segments | Sequence[Segments], dim: int = 1) -> torch.Tensor:
    """x shifted by one token along `dim` (each token replaced by the one before it in its document, zeros at a
    document start), as over the full rows: RWKV's time shift, nn.ZeroPad2d((0, 0, 1, -1))."""
    outs = []
    for sl, seg in by_row(segs, x.shape[0]):
        ext, keep = halo(x[sl], 1, cp, seg, dim=dim)
        outs.append(ext.index_select(dim, keep - 1))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def last_token(x: torch.Tensor, cp, segs: Segments | Sequence[Segments], at: int, dim: int = 1) -> torch.Tensor:
    """The token before global position `at` (a row end), on every rank: x without its `dim`."""
    return torch.cat([tail(x[sl], 1, cp, seg, at=at, dim=dim).select(dim, 0) for sl, seg in by_row(segs, x.shape[0])])


def fresh(*tensors: torch.Tensor | None, empty: Sequence[float] | None = None) -> bool:
    """Whether a state handed in is the model's own starting state (zeros, or `empty` per tensor): what a plain
    forward creates for itself, no state at all under CP; anything else is a cache to continue from."""
    values = empty or (0.0,) * len(tensors)
    return all(t is None or bool((t == v).all()) for t, v in zip(tensors, values))


__all__ = ["shadowed", "shift", "last_token", "fresh"]
