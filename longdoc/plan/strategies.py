"""The four CP attention strategies in the planner: bytes moved, over which link, what overlaps, buffers.

Per layer and pass, with N tokens per rank, kv = kv_heads*head_dim, q = heads*head_dim, c bytes per element:
  ring       cp steps; K/V (2*N*kv*c) go to the next rank while 1/cp of the attention is computed, so a step
             takes max(compute, message); the backward also sends the fp32 dK/dV (2*N*kv*4), the last one
             exposed. Link: the group's span (cp consecutive ranks).
  allgather  no overlap: (cp-1) K/V blocks gathered before the kernel, dK/dV reduce-scattered after it.
  ulysses    no overlap: one all-to-all sends q, k, v to the ranks owning their heads and a second brings the
             output back (and the same for the gradients); bytes from longdoc.parallel.traffic, which the tests
             check against counted gloo traffic. Then one kernel over the whole sequence for this rank's heads:
             with query heads uneven over the ranks the largest share sets the time (`head_balance`).
  usp U x R  Ulysses over U consecutive ranks (U*N tokens after it), then the ring over the R groups with the
             K/V heads a Ulysses rank holds; the all-to-alls use the U-span link, the ring the cp-span link
             (across nodes once cp > a node's GPUs while U fits in one).
Times are bytes / (link bandwidth x link efficiency) + a latency per message: formulas, with the assumptions of
`hardware.Assumptions` (GPU figures are not yet measured on a device).
"""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.parallel.traffic import ulysses_traffic
from longdoc.parallel.ulysses import split_heads


def ulysses_size(strategy: str, cp: int, ulysses: int | None) -> int:
    """Ranks per Ulysses group: cp for ulysses, the factor for usp, 1 for ring and allgather."""
    if strategy == "ulysses":
        return cp
    if strategy == "usp":
        if ulysses is None or cp % ulysses:
            raise ValueError(f"usp needs ulysses_size, a divisor of cp {cp}; got {ulysses!r}")
        return ulysses
    return 1


def check_heads(strategy: str, cp: int, ulysses: int | None, q_heads: int) -> None:
    """Ulysses splits query heads over its ranks: fewer heads than ranks is refused (as the CP core does)."""
    u = ulysses_size(strategy, cp, ulysses)
    if u > q_heads:
        raise ValueError(f"strategy {strategy!r} with {u} Ulysses ranks needs at least {u} query heads, the model has "
                         f"{q_heads}; use a smaller cp / ulysses_size, or ring/allgather")


def kernel_block(strategy: str, cp: int, ulysses: int | None, tokens: int) -> int:
    """Query tokens of one attention kernel call: a zigzag chunk (N/2) for ring and allgather, the whole
    sequence (cp*N) for Ulysses, a zigzag chunk of the U*N-token group for usp; N at cp=1."""
    if cp == 1:
        return tokens
    u = ulysses_size(strategy, cp, ulysses)
    return tokens * cp if u == cp else max(1, u * tokens // 2)


def kernel_efficiency(block: int, knee: float) -> float:
    """Fraction of the large-block attention rate reached on `block`-token query blocks (hardware.Device)."""
    return block / (block + knee)


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


@dataclass(frozen=True)
class LayerComm:
    forward_s: float  # one layer's attention forward, communication included (exposed or hidden)
    backward_s: float  # its backward (the recompute's forward is the caller's)
    forward_bytes: float  # bytes this rank sends in the forward
    backward_bytes: float


def attention_layer(strategy: str, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int,
                    head_dim: int, c: int, t_fwd: float, t_bwd: float, bw_span, lat: float) -> LayerComm:
    """Time and bytes of one layer's attention. t_fwd/t_bwd: its kernel time at an even share of the work;
    bw_span(ranks): bytes/s of a group spanning that many consecutive ranks."""
    kv = kv_heads * head_dim
    if cp == 1:
        return LayerComm(t_fwd, t_bwd, 0.0, 0.0)
    if strategy == "ring":
        m_kv, m_dkv = 2.0 * tokens * kv * c, 2.0 * tokens * kv * 4
        bw = bw_span(cp)
        return LayerComm(ring_pass(t_fwd, cp, m_kv, 0.0, bw, lat), ring_pass(t_bwd, cp, m_kv + m_dkv, m_dkv, bw, lat),
                         (cp - 1) * m_kv, (cp - 1) * m_kv + cp * m_dkv)
    if strategy == "allgather":
        m_kv, m_dkv = 2.0 * tokens * kv * c, 2.0 * tokens * kv * 4
        bw = bw_span(cp)
        gather, scatter = (cp - 1) * (m_kv / bw + lat), (cp - 1) * (m_dkv / bw + lat)
        return LayerComm(t_fwd + gather, t_bwd + gather + scatter, (cp - 1) * m_kv, (cp - 1) * (m_kv + m_dkv))
    u = ulysses_size(strategy, cp, ulysses)
    r = cp // u
    a2a = all_to_all(u, tokens, q_heads, kv_heads, head_dim, c)
    bw_u = bw_span(u)
    # two all-to-alls per pass, each (u-1) messages
    a2a_f, a2a_b = a2a.forward / bw_u + 2 * (u - 1) * lat, a2a.backward / bw_u + 2 * (u - 1) * lat
    bal = head_balance(q_heads, kv_heads, u)
    kf, kb = t_fwd * bal, t_bwd * bal
    if r == 1:
        return LayerComm(a2a_f + kf, a2a_b + kb, a2a.forward, a2a.backward)
    kvl = a2a.kv_heads * head_dim
    m_kv, m_dkv = 2.0 * u * tokens * kvl * c, 2.0 * u * tokens * kvl * 4
    bw_r = bw_span(cp)
    return LayerComm(a2a_f + ring_pass(kf, r, m_kv, 0.0, bw_r, lat),
                     a2a_b + ring_pass(kb, r, m_kv + m_dkv, m_dkv, bw_r, lat),
                     a2a.forward + (r - 1) * m_kv, a2a.backward + (r - 1) * m_kv + r * m_dkv)


def buffers(strategy: str, *, cp: int, ulysses: int | None, tokens: int, q_heads: int, kv_heads: int,
            head_dim: int, c: int) -> tuple[float, str]:
    """Bytes of the strategy's communication buffers live in a layer's attention backward, and the formula."""
    n, kv, q = tokens, kv_heads * head_dim, q_heads * head_dim
    if strategy == "ring":
        k = 3 if cp > 1 else 1
        return (2 * (2 * n * kv * c) + k * 2 * n * kv * 4,
                f"2*(2*N*kv*c) + {k}*(2*N*kv*4) = 2*(2*{n:,}*{kv}*{c}) + {k}*(2*{n:,}*{kv}*4)")
    if strategy == "allgather":
        full = cp * 2 * n * kv
        return 2 * full * c + 2 * full * 4, f"2*cp*2*N*kv*(c + 4) = 2*{cp}*2*{n:,}*{kv}*({c} + 4)"
    u = ulysses_size(strategy, cp, ulysses)
    a2a = all_to_all(u, n, q_heads, kv_heads, head_dim, c)
    hq, hkv = a2a.q_heads * head_dim, a2a.kv_heads * head_dim
    # the gradients of q, k, v in both layouts (token: N*(q + 2kv); head: U*N*(q_u + 2kv_u)) and their
    # all-to-all staging copies: 2x each
    total = 2 * n * (q + 2 * kv) * c + 2 * u * n * (hq + 2 * hkv) * c
    formula = (f"2*N*(q + 2kv)*c + 2*U*N*(q_U + 2kv_U)*c = 2*{n:,}*({q} + 2*{kv})*{c} + "
               f"2*{u}*{n:,}*({hq} + 2*{hkv})*{c}")
    if cp // u > 1:  # usp: the outer ring's double buffer and dK/dV in flight over U*N tokens, kv_U heads
        total += 2 * (2 * u * n * hkv * c) + 3 * 2 * u * n * hkv * 4
        formula += f" + ring over U*N tokens: 2*(2*{u}*{n:,}*{hkv}*{c}) + 3*(2*{u}*{n:,}*{hkv}*4)"
    return total, formula
