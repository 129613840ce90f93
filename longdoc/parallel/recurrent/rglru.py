"""The RG-LRU (RecurrentGemma / Griffin) as an affine state map, for state passing.

Per channel, h_t = a_t h_{t-1} + x_t with a diagonal gate a_t (zeroed where `reset`, a document start). Over a
piece entered with h_in:
    h_out = P_L h_in + U,        h_t = h0_t + P_t h_in,        P_t = a_1 ... a_t   (cumulative, fp32)
where (h0, U) is the piece run from a zero state by the model's own scan (`scan(hidden_states=, recurrent_gate=,
reset=, recurrent_states=)`, transformers' RecurrentGemmaRglru._rnn_scan), given fp32 inputs so that h0 comes back
in fp32 and the correction is added before the one rounding to the model's dtype.
Torch only: this module knows no model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class RglruPiece(NamedTuple):
    out0: torch.Tensor  # (batch, len, width) fp32: from a zero state
    gains: torch.Tensor  # (batch, len, width) fp32: P_t
    offset: torch.Tensor  # (batch, width) fp32: U

    @property
    def transition(self) -> torch.Tensor:
        return self.gains[:, -1]


def run_piece(scan: Callable, x: torch.Tensor, gate: torch.Tensor, reset: torch.Tensor) -> RglruPiece:
    """x: (batch, len, width) the normalised inputs; gate: a_t (batch, len, width); reset: (batch, len, 1) bool."""
    out0, offset = scan(hidden_states=x.float(), recurrent_gate=gate, reset=reset, recurrent_states=None)
    gains = torch.cumprod((gate * ~reset).float(), dim=1)
    return RglruPiece(out0.float(), gains, offset.float())


def advance(state: torch.Tensor | None, transition: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return offset if state is None else transition * state + offset


def finish(piece: RglruPiece, state: torch.Tensor | None) -> torch.Tensor:
    """The piece's output (batch, len, width) fp32 when entered with `state` (None: zero)."""
    return piece.out0 if state is None else piece.out0 + piece.gains * state[:, None].float()


def scan(scan_fn: Callable, x, gate, reset, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    piece = run_piece(scan_fn, x, gate, reset)
    return finish(piece, state), advance(state, piece.transition, piece.offset)


class Rglru:
    """The state-passing contract (longdoc.parallel.recurrent.protocol.Recurrence) for one RG-LRU layer.

    A piece is (x, gate, reset), time at dim 1; the state is (h,) fp32 (batch, width); the summary (P_L, U).
    Outputs are fp32.
    """

    def __init__(self, scan_fn: Callable):
        self.scan_fn = scan_fn

    def local(self, piece):
        p = run_piece(self.scan_fn, *piece)
        return p.out0, (p.transition, p.offset)

    def advance(self, state, summary):
        return (advance(None if state is None else state[0], *summary),)

    def finish(self, piece, y0, state):
        _, gate, reset = piece
        return y0 + torch.cumprod((gate * ~reset).float(), dim=1) * state[0][:, None].float()


__all__ = ["Rglru", "RglruPiece", "run_piece", "advance", "finish", "scan"]
