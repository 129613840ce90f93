"""State passing: a recurrent layer over CP-sharded tokens, exact, with one all-gather of small summaries.

    y_local, final = run(recurrence, (x, dt, B, C), cp, segments, final_at=seq_len)

Every rank runs each of its pieces (longdoc.parallel.recurrent.segments) from a zero state, getting the piece's
output y0 and its *summary* (tensors whose size does not depend on the piece's length, e.g. (T, U) of
S_out = T * S_in + U). The summaries are all-gathered, and every rank composes them in global order, document
by document (the state is zero at each document start), which gives the true entering state of each of its
pieces; `finish` corrects (or re-runs) the piece from that state. Gather and compose are one autograd node
(`_GatherCompose`) that saves only the rank's own summaries: its backward gathers them again, recomputes the
composition and reduce-scatters the gradients, so the gradient of an entering state flows back to the rank that
produced it and the memory a rank keeps for backward does not grow with cp. See the package docstring for the
`Recurrence` contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from longdoc.parallel.recurrent import exchange
from longdoc.parallel.recurrent.protocol import Recurrence, State
from longdoc.parallel.recurrent.segments import Piece, Segments


class Result(NamedTuple):
    y: torch.Tensor  # this rank's outputs, its tokens in local order
    final: State | None  # the state at global position `final_at` (identical on every rank), if asked


def _dims(dims: int | Sequence[int], n: int) -> tuple[int, ...]:
    return (dims,) * n if isinstance(dims, int) else tuple(dims)


def _piece(inputs: Sequence[torch.Tensor], dims: tuple[int, ...], piece: Piece) -> tuple[torch.Tensor, ...]:
    return tuple(x.narrow(d, piece.offset, piece.length) for x, d in zip(inputs, dims))


def run(rec: Recurrence, inputs: Sequence[torch.Tensor], cp, segments: Segments | Sequence[Segments], *,
        dims: int | Sequence[int] = 1, out_dim: int = 1, final_at: int | None = None) -> Result:
    """This rank's outputs of the recurrence `rec` over the full row(s), and optionally the state at global
    position `final_at` (a document end; e.g. the end of a prompt before its padding), on every rank.

    inputs: this rank's tensors, batch first, their time dimension at `dims` (one int, or one per input), the
    tokens in local order (cp.shard). segments: one Segments for the whole batch, or one per row (rows packed
    differently run one by one; every rank loops alike). The output's time dimension is `out_dim`.
    """
    dims = _dims(dims, len(inputs))
    if not isinstance(segments, Segments):
        rows = list(segments)
        if all(s == rows[0] for s in rows):
            segments = rows[0]
        else:
            parts = [_run_one(rec, [x.narrow(0, b, 1) for x in inputs], cp, s, dims, out_dim, final_at)
                     for b, s in enumerate(rows)]
            final = None if final_at is None else tuple(torch.cat(f, dim=0) for f in zip(*(p.final for p in parts)))
            return Result(torch.cat([p.y for p in parts], dim=0), final)
    return _run_one(rec, inputs, cp, segments, dims, out_dim, final_at)


def _run_one(rec: Recurrence, inputs, cp, segments: Segments, dims: tuple[int, ...], out_dim: int,
             final_at: int | None) -> Result:
    if segments.world_size != cp.size:
        raise ValueError(f"state passing: segments for {segments.world_size} ranks, the CP group has {cp.size}")
    everyone = segments.all_pieces()
    mine = everyone[cp.rank]
    # [(y0, summary, carry)] from zero states; carry: what `finish` reuses (a recurrence may return only 2)
    local = [_local(rec, _piece(inputs, dims, p)) for p in mine]
    summaries = [s for _, s, _ in local]
    n_max = max(len(p) for p in everyone)
    token, entering, final = _gather_compose(rec, everyone, _stack(summaries, n_max), cp, final_at)
    ys = [y0 if entering[i] is None and y0 is not None else _finish(rec, _piece(inputs, dims, p), y0, entering[i], c)
          for i, (p, (y0, _, c)) in enumerate(zip(mine, local))]
    y = torch.cat(ys, dim=out_dim) if len(ys) > 1 else ys[0]
    return Result(exchange.anchor(y, [token]), final)


def _local(rec: Recurrence, piece: tuple[torch.Tensor, ...]) -> tuple:
    out = rec.local(piece)
    return (*out, None) if len(out) == 2 else tuple(out)


def _finish(rec: Recurrence, piece, y0, state, carry):
    # y0 None: the recurrence skipped the zero-state output (its finish re-runs the piece anyway), so finish
    # runs for every piece, with state None at a document start
    return rec.finish(piece, y0, state) if carry is None else rec.finish(piece, y0, state, carry)


def _stack(summaries: list[tuple[torch.Tensor, ...]], n_max: int) -> list[torch.Tensor]:
    """This rank's piece summaries, per summary tensor (n_max, *shape); a rank with fewer pieces pads with zeros
    (never read)."""
    stacked = [torch.stack(list(ts)) for ts in zip(*summaries)]  # per tensor (pieces, *shape)
    return [torch.cat([t, t.new_zeros((n_max - t.shape[0], *t.shape[1:]))]) if t.shape[0] < n_max else t
            for t in stacked]


def _gather_compose(rec: Recurrence, everyone, local: list[torch.Tensor], cp, final_at: int | None):
    """(token, entering, final): `_compose` over every rank's summaries (all-gathered), differentiable with respect
    to this rank's summaries `local`; `token` is a zero scalar to anchor the output to, so that every rank runs
    the backward (and its collectives)."""
    layout: list = []  # the forward fills it: how to rebuild the states from its flat outputs
    out = _GatherCompose.apply((rec, everyone, cp, final_at, layout), *local)
    entering, final = _unflatten(list(out[1:]), layout)
    return out[0], entering, final


class _GatherCompose(torch.autograd.Function):
    """All-gather the summaries and compose them, saving only this rank's own summaries for backward.

    Autograd through `exchange.all_gather` and `_compose` would keep every rank's summaries (world x pieces) and
    every composed state until backward: per rank, memory that grows with cp (for a production Mamba2 layer
    about 128 MiB at cp=8). Here the forward runs without a graph; the backward gathers the summaries again
    (one all-gather), recomputes the composition with a graph, and sends each rank the gradient of its own
    summaries (one reduce-scatter). The arithmetic is the same, so outputs and gradients are bitwise those of
    the differentiable path.
    """

    @staticmethod
    def forward(ctx, plan, *local):
        rec, everyone, cp, final_at, layout = plan
        ctx.plan = plan
        ctx.save_for_backward(*local)
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            entering, final = _compose(rec, everyone, exchange.gather(local, cp), cp.rank, final_at)
        flat, shape = _flatten(entering, final)
        layout[:] = shape
        # a state that is one piece's summary (entered at a document start) is a view of the gathered buffer:
        # copied, so that what finish saves does not keep every rank's summaries alive
        return (local[0].new_zeros(()), *(t.clone() if t._base is not None else t for t in flat))

    @staticmethod
    def backward(ctx, _token, *grads):
        rec, everyone, cp, final_at, _ = ctx.plan
        local = ctx.saved_tensors
        with torch.no_grad():
            gathered = [g.detach().requires_grad_() for g in exchange.gather(local, cp)]
        d_gathered = [None] * len(gathered)
        with torch.enable_grad():
            flat, _ = _flatten(*_compose(rec, everyone, gathered, cp.rank, final_at))
            pairs = [(o, g) for o, g in zip(flat, grads) if g is not None and o.requires_grad]
            if pairs:
                d_gathered = list(torch.autograd.grad([o for o, _ in pairs], gathered, [g for _, g in pairs],
                                                      allow_unused=True))
        d_gathered = [torch.zeros_like(g) if d is None else d for g, d in zip(gathered, d_gathered)]
        return (None, *exchange.scatter_grads(d_gathered, local, cp))


def _flatten(entering: list[State | None], final: State | None) -> tuple[list[torch.Tensor], list]:
    """The states' tensors in one list, and the layout to rebuild them: per state, None or (its type, its count)."""
    flat, layout = [], []
    for state in (*entering, final):
        if state is None:
            layout.append(None)
        else:
            flat.extend(state)
            layout.append((type(state), len(state)))
    return flat, layout


def _unflatten(flat: list[torch.Tensor], layout: list) -> tuple[list[State | None], State | None]:
    states, at = [], 0
    for item in layout:
        if item is None:
            states.append(None)
            continue
        kind, n = item
        part = flat[at:at + n]
        at += n
        states.append(kind(*part) if hasattr(kind, "_fields") else kind(part))
    return states[:-1], states[-1]


def _compose(rec: Recurrence, everyone: tuple[tuple[Piece, ...], ...], gathered: list[torch.Tensor],
             rank: int, final_at: int | None) -> tuple[list[State | None], State | None]:
    """Entering state of each of `rank`'s pieces (None: a document start, the zero state), and the state at
    `final_at`: every piece of every rank in global order, the state reset at each document start."""
    order = sorted(((p.start, r, i, p) for r, ps in enumerate(everyone) for i, p in enumerate(ps)))
    entering: list[State | None] = [None] * len(everyone[rank])
    state: State | None = None
    doc, final = -1, None
    last_mine = everyone[rank][-1].start
    for _, r, i, p in order:
        if p.doc != doc:
            doc, state = p.doc, None  # a document start: the zero state
        if r == rank:
            entering[i] = state
        if p.start >= last_mine and (final_at is None or p.start >= final_at):
            break  # nothing later is needed on this rank
        state = rec.advance(state, tuple(g[r, i] for g in gathered))
        if p.end == final_at:
            final = state
    if final_at is not None and final is None:
        ends = sorted({p.end for ps in everyone for p in ps})
        raise ValueError(f"state passing: final_at={final_at} is not the end of a piece (a document end); piece "
                         f"ends are {ends[:8]}{'...' if len(ends) > 8 else ''}")
    return entering, final
