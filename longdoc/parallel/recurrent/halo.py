"""Conv halos: the previous tokens of the same document that a causal convolution needs, from any rank.

    x_ext, keep = halo(x, kernel - 1, cp, segments, dim=-1)
    y = causal_conv(x_ext).index_select(-1, keep)      # == this rank's shard of causal_conv(full x)

A causal conv of kernel K at a piece's first token needs the K-1 tokens before it in its document (zeros
before the document start). Those tokens are the last K-1 tokens of the pieces before it, on whichever ranks
hold them (pieces may be shorter than K-1). Every rank all-gathers the last n tokens of each of its pieces
(exchange.all_gather: differentiable, so the halo's gradient flows back to its rank) and builds, for each piece,
its halo: `x_ext` is every piece preceded by its n halo tokens, so one convolution over x_ext is exact for every
real token, and `keep` indexes the real tokens. `tail` gives the n tokens before a document end, on every rank
(the conv cache a decode continues from).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from longdoc.parallel.recurrent import exchange
from longdoc.parallel.recurrent.segments import Segments


class Halo(NamedTuple):
    x: torch.Tensor  # every local piece preceded by its n halo tokens, along the time dimension
    keep: torch.Tensor  # LongTensor: where the real tokens of x are, in local order


def _table(xt: torch.Tensor, n: int, cp, segments: Segments) -> tuple[torch.Tensor, dict[int, int]]:
    """All ranks' last n tokens of every piece, flat: (slots + 1, *batch dims) with a zero row last, and
    global position -> slot. xt: this rank's tokens with time last."""
    everyone = segments.all_pieces()
    n_max = max(len(ps) for ps in everyone)
    tails = []
    for p in everyone[cp.rank]:
        m = min(n, p.length)
        tails.append(torch.nn.functional.pad(xt[..., p.offset + p.length - m:p.offset + p.length], (n - m, 0)))
    tails += [xt.new_zeros((*xt.shape[:-1], n))] * (n_max - len(tails))
    (gathered,) = exchange.all_gather([torch.stack(tails)], cp)  # (world, n_max, *batch, n)
    flat = gathered.movedim(-1, 2).reshape(-1, *xt.shape[:-1])  # (world * n_max * n, *batch)
    flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
    slots = {}
    for r, ps in enumerate(everyone):
        for i, p in enumerate(ps):
            for j in range(n - min(n, p.length), n):
                slots[p.end - n + j] = (r * n_max + i) * n + j
    return flat, slots


def _take(flat: torch.Tensor, slots: dict[int, int], positions: range, doc: int) -> torch.Tensor:
    """The tokens at global `positions` (zeros before the document start `doc`): (*batch, len(positions))."""
    zero = flat.shape[0] - 1
    index = torch.tensor([slots[q] if q >= doc else zero for q in positions], device=flat.device, dtype=torch.long)
    return flat.index_select(0, index).movedim(0, -1)


def halo(x: torch.Tensor, n: int, cp, segments: Segments, dim: int = -1) -> Halo:
    """Every local piece of `x` (this rank's tokens along `dim`) preceded by the n tokens before it in its
    document; see the module docstring."""
    xt = x.movedim(dim, -1)
    if n == 0:
        return Halo(x, torch.arange(x.shape[dim], device=x.device))
    flat, slots = _table(xt, n, cp, segments)
    parts, keep, offset = [], [], 0
    for p in segments.pieces(cp.rank):
        parts += [_take(flat, slots, range(p.start - n, p.start), p.doc).to(xt.dtype),
                  xt[..., p.offset:p.offset + p.length]]
        keep.append(torch.arange(offset + n, offset + n + p.length))
        offset += n + p.length
    return Halo(torch.cat(parts, dim=-1).movedim(-1, dim), torch.cat(keep).to(x.device))


def tail(x: torch.Tensor, n: int, cp, segments: Segments, at: int, dim: int = -1) -> torch.Tensor:
    """The n tokens before global position `at` (a document end) in that document, zeros before its start,
    identical on every rank: (*batch, n) with time at `dim`."""
    xt = x.movedim(dim, -1)
    flat, slots = _table(xt, n, cp, segments)
    return _take(flat, slots, range(at - n, at), segments.doc_of(max(at - 1, 0))).to(xt.dtype).movedim(-1, dim)
