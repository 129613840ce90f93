"""Strategy "ring": K/V blocks rotate around the CP group while each rank computes on the block it holds, so memory
stays O(local) and each message hides behind a step of compute (longdoc/parallel/ring.py)."""

from __future__ import annotations

from longdoc.parallel.cost import ring_pass
from longdoc.parallel.ring import ring_attention
from longdoc.parallel.strategy import LayerComm, Strategy, register
from longdoc.parallel.traffic import ring_traffic


class Ring(Strategy):
    name = "ring"
    order = 0

    def attend(self, q, k, v, cp, causal, scale, kernel, **extra):
        return ring_attention(q, k, v, cp._ring, cp.layout, causal, scale, kernel, **extra)

    def bytes_sent(self, *, cp_size, local_len, q_heads, kv_heads, head_dim, itemsize, batch, ulysses_size, rank,
                   ring_steps, backend):
        return ring_traffic(cp_size, local_len, kv_heads, head_dim, batch, itemsize, ring_steps)

    def layer_cost(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c, t_fwd, t_bwd, bw_span, lat):
        # cp steps; K/V (2*N*kv*c) go to the next rank while 1/cp of the attention is computed, so a step takes
        # max(compute, message); the backward also sends the fp32 dK/dV (2*N*kv*4), the last one exposed. Link:
        # the group's span (cp consecutive ranks)
        kv = kv_heads * head_dim
        m_kv, m_dkv = 2.0 * tokens * kv * c, 2.0 * tokens * kv * 4
        bw = bw_span(cp)
        return LayerComm(ring_pass(t_fwd, cp, m_kv, 0.0, bw, lat), ring_pass(t_bwd, cp, m_kv + m_dkv, m_dkv, bw, lat),
                         (cp - 1) * m_kv, (cp - 1) * m_kv + cp * m_dkv)

    def buffers(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c):
        n, kv = tokens, kv_heads * head_dim
        k = 3 if cp > 1 else 1
        return (2 * (2 * n * kv * c) + k * 2 * n * kv * 4,
                f"2*(2*N*kv*c) + {k}*(2*N*kv*4) = 2*(2*{n:,}*{kv}*{c}) + {k}*(2*{n:,}*{kv}*4)")


register(Ring())
