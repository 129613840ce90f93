"""RWKV-4 "WKV" linear attention as a state map with a max-stabilised combine, for state passing.

Per channel, with w = -exp(time_decay) < 0, the real state is a numerator and a denominator
    num_t = e^w num_{t-1} + e^{k_t} v_t,        den_t = e^w den_{t-1} + e^{k_t},
kept as (num, den, m) with real = (num, den) * e^m so nothing overflows. Over a piece of L tokens the map is
diagonal with transition e^{w L}: the state entering the next piece is the max-stabilised sum
    m' = max(m + w L, m_p),  num' = e^{m + w L - m'} num + e^{m_p - m'} num_p   (den likewise)
of the entering state and the piece's own state (num_p, den_p, m_p) from an empty one, which has a closed form
(one log-sum-exp over the piece's keys, no scan). The output num/den is not linear in the entering state, so a
piece's output is the model's own scan (transformers' rwkv_linear_attention_cpu) entered with the true state.
Torch only: this module knows no model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class RwkvState(NamedTuple):
    num: torch.Tensor  # (batch, channels) fp32
    den: torch.Tensor  # (batch, channels) fp32
    max: torch.Tensor  # (batch, channels) fp32: the stabiliser, real = (num, den) * exp(max)


def summary(time_decay: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> RwkvState:
    """The state after a piece entered with an empty one. key, value: (batch, len, channels)."""
    length = key.shape[1]
    w = -torch.exp(time_decay.float())
    age = torch.arange(length - 1, -1, -1, device=key.device, dtype=torch.float32)[:, None]  # L-1-j
    expo = key.float() + w * age  # (batch, len, channels): log of each token's weight in the final state
    top = expo.max(dim=1).values
    weight = torch.exp(expo - top[:, None])
    return RwkvState((weight * value.float()).sum(1), weight.sum(1), top)


class Wkv:
    """The state-passing contract (longdoc.parallel.recurrent.protocol.Recurrence) for one RWKV-4 attention.

    A piece is (key, value), (batch, len, channels), time at dim 1; the state is (num, den, max) fp32; the summary
    is (w L, num_p, den_p, max_p). `local` returns no output (None): the output of every piece is the model's scan
    `scan(time_decay, time_first, key, value, state=[num, den, max] | None)` run once, from its true state.
    """

    def __init__(self, scan_fn: Callable, time_decay: torch.Tensor, time_first: torch.Tensor):
        self.scan_fn, self.time_decay, self.time_first = scan_fn, time_decay, time_first

    def local(self, piece):
        key, value = piece
        own = summary(self.time_decay, key, value)
        log_decay = (-torch.exp(self.time_decay.float()) * key.shape[1]).expand_as(own.num)
        return None, (log_decay, *own)

    def advance(self, state, summary):
        log_decay, num, den, top = summary
        piece = RwkvState(num, den, top)
        if state is None:
            return piece
        decayed = state[2] + log_decay
        new_top = torch.maximum(decayed, top)
        a, b = torch.exp(decayed - new_top), torch.exp(top - new_top)
        return RwkvState(a * state[0] + b * num, a * state[1] + b * den, new_top)

    def finish(self, piece, y0, state):
        key, value = piece
        out, _ = self.scan_fn(self.time_decay, self.time_first, key, value,
                              state=None if state is None else list(state), return_state=False)
        return out


__all__ = ["RwkvState", "Wkv", "summary"]
