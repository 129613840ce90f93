"""One-process stand-in for the state-passing driver, for the recurrences' unit tests: run a sequence as pieces
(each from the zero state, as on different ranks), compose their summaries in order (resetting at document
starts) and finish every piece from its entering state, following the Recurrence contract."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compose(rec, inputs: Sequence[torch.Tensor], dims: Sequence[int], cuts: Sequence[int],
            starts: Sequence[int] = (0,), out_dim: int = 1):
    """(outputs over the whole sequence, final state) of `rec` run as pieces of lengths `cuts`; `starts`: the
    document starts (the state resets there); every piece lies within one document."""
    state, ys, start = None, [], 0
    for n in cuts:
        piece = tuple(x.narrow(d, start, n) for x, d in zip(inputs, dims))
        out = rec.local(piece)
        y0, summary, carry = (*out, None) if len(out) == 2 else out
        if start in starts:
            state = None
        if state is None and y0 is not None:
            y = y0
        elif carry is not None:
            y = rec.finish(piece, y0, state, carry)
        else:
            y = rec.finish(piece, y0, state)
        ys.append(y)
        state = rec.advance(state, summary)
        start += n
    return torch.cat(ys, dim=out_dim), state
