"""State passing for recurrent layers under context parallelism, and conv halos. Torch only; knows no model.

A recurrent layer (SSM, linear attention, RNN) carries a state that is an affine function of the state
entering a run of tokens: S_out = T * S_in + U. Under CP each rank holds *pieces* of the sequence (runs of
consecutive positions of one document; zigzag: two per rank, packed rows: per document, see `Segments`).

    segments = Segments.of(cp.layout, cp.size, seq_len, documents)     # identical on every rank
    y_local, final = run(recurrence, (x, dt, B, C), cp, segments, dims=1, final_at=None)
    x_ext, keep = halo(x, kernel - 1, cp, segments, dim=-1)            # causal conv: previous tokens
    conv_cache = tail(x, kernel, cp, segments, at=prompt_len)         # decode: the last tokens, everywhere

The contract a recurrence implements (`Recurrence`; all tensors batch first, a state is a tuple of tensors):
    local(piece) -> (y0, summary) or (y0, summary, carry)
        run the piece (the inputs narrowed to its tokens along their time dims) from the ZERO state; y0 is its
        output, summary a tuple of tensors whose shapes do not depend on the piece's length (e.g. (log T, U)).
        Optional: a carry that `finish` gets back (what the correction reuses, e.g. the delta rule's reads of
        the entering state); y0 None when `finish` computes every output itself (RWKV, mLSTM re-run the piece
        from its true state, so a zero-state output would be wasted): finish then runs at document starts too.
    advance(state | None, summary) -> state
        the state after that piece when entered with `state` (None = the zero state, e.g. return U). Any
        associative combine works here: a dense T, or a max-stabilised (log-space) combine for RWKV / mLSTM.
    finish(piece, y0, state[, carry]) -> y
        the piece's output when entered with the state (never None, unless y0 was None): an additive correction
        for diagonal transitions (see diagonal.py), or a re-run of the local scan from `state`.
What `run` does: every rank calls `local` on each of its pieces; the summaries are all-gathered in ONE
collective (`exchange.all_gather`, differentiable: the gradient of an entering state reaches the rank that
produced it); every rank composes them with `advance` in global order, resetting to the zero state at every
document start, and calls `finish` on its pieces that do not start a document. `final_at` (a document end,
e.g. the prompt's end before the padding a prefill adds) also returns the state there, on every rank: what
decoding continues from. Backward gathers the summaries again (only each rank's own are kept for it, so the
memory does not grow with cp), recomputes the composition and runs the collective's reverse (a reduce-scatter)
on every rank, even one that needed no other rank's state (`exchange.anchor`).

Costs: one all-gather of (pieces per rank) x (summary size) per layer, independent of the sequence length;
compose is (all pieces) x advance, on every rank. Backward repeats that all-gather and compose, then runs its
reverse (a reduce-scatter).
"""

from longdoc.parallel.recurrent.diagonal import SSD, Selective
from longdoc.parallel.recurrent.exchange import all_gather, anchor
from longdoc.parallel.recurrent.halo import Halo, halo, tail
from longdoc.parallel.recurrent.protocol import Recurrence, State, Summary
from longdoc.parallel.recurrent.segments import Piece, Segments, by_row
from longdoc.parallel.recurrent.state import Result, run

__all__ = ["Recurrence", "State", "Summary", "Segments", "Piece", "by_row", "Result", "run", "halo", "tail", "Halo",
           "all_gather", "anchor", "SSD", "Selective"]
