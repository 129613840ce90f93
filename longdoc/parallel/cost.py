"""The pieces of the planner's per-layer attention time that the strategies share: a ring pass that overlaps its
messages with the compute, the busiest rank of a Ulysses all-to-all, and the cost of uneven head shares.

Times are bytes / (link bandwidth x link efficiency) + a latency per message (the planner passes both in);
pure arithmetic, no torch.distributed needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.parallel.traffic import ulysses_traffic
from longdoc.parallel.ulysses import split_heads


def head_balance(q_heads: int, kv_heads: int, u: int) -> float:
    """Time of the slowest Ulysses rank's kernel over an even split: largest head range * u / q_heads."""
    if u == 1:
        return 1.0
    heads = split_heads(q_heads, kv_heads, u)
    return max(b - a for a, b in heads.q) * u / q_heads


@dataclass(frozen=True)
class A2A:
    forward: float  # bytes the busiest Ulysses rank sends in one layer's forward all-to-alls
    backward: float
    kv_heads: int  # K/V heads a Ulysses rank holds after the all-to-all (the usp ring carries these)
    q_heads: int  # the largest query-head range


def all_to_all(u: int, tokens: int, q_heads: int, kv_heads: int, head_dim: int, c: int) -> A2A:
    """The busiest rank of a u-rank Ulysses group holding `tokens` tokens each (batch folded into tokens)."""
    if u == 1:
        return A2A(0.0, 0.0, kv_heads, q_heads)
    per = [ulysses_traffic(u, r, tokens, q_heads, kv_heads, head_dim, 1, c) for r in range(u)]
    heads = split_heads(q_heads, kv_heads, u)
    return A2A(max(t.forward for t, _ in per), max(t.backward for t, _ in per), max(k for _, k in per),
               max(b - a for a, b in heads.q))


def ring_pass(compute: float, steps: int, step_bytes: float, tail_bytes: float, bw: float, lat: float) -> float:
    """One ring pass over `steps` steps: each step max(its compute, its message), plus an exposed tail message."""
    if steps == 1:
        return compute
    per_step = compute / steps
    msg = step_bytes / bw + lat
    tail = tail_bytes / bw + lat if tail_bytes else 0.0
    return (steps - 1) * max(per_step, msg) + per_step + tail
