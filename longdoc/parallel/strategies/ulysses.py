"""Strategy "ulysses": a heads all-to-all, so every rank attends over the full sequence for its share of the heads;
no ring. The class also holds the Ulysses x ring arithmetic that usp (strategies/usp.py) runs with a smaller
Ulysses group: here the group is the whole CP group and the ring has one step (longdoc/parallel/ulysses.py)."""

from __future__ import annotations

from longdoc.parallel.cost import all_to_all, head_balance, ring_pass
from longdoc.parallel.strategy import LayerComm, Strategy, Traffic, register
from longdoc.parallel.traffic import ring_traffic, ulysses_traffic
from longdoc.parallel.ulysses import ulysses_attention


class Ulysses(Strategy):
    name = "ulysses"
    order = 2
    selects_keys = False  # selected-key attention is not built for the head all-to-all

    def heads_split(self, cp_size, ulysses_size):
        return cp_size

    def attend(self, q, k, v, cp, causal, scale, kernel, **extra):
        extra.pop("selected")  # None here: longdoc.attention refuses selected keys where selects_keys is False
        grid = cp._grid(self.heads_split(cp.size, cp.ulysses_size))
        return ulysses_attention(q, k, v, grid, causal, scale, kernel, **extra)

    def bytes_sent(self, *, cp_size, local_len, q_heads, kv_heads, head_dim, itemsize, batch, ulysses_size, rank,
                   ring_steps, backend):
        u = self.heads_split(cp_size, ulysses_size)
        a2a, kv_local = ulysses_traffic(u, rank % u, local_len, q_heads, kv_heads, head_dim, batch, itemsize)
        ring = ring_traffic(cp_size // u, u * local_len, kv_local, head_dim, batch, itemsize, ring_steps)
        return Traffic(a2a.forward + ring.forward, a2a.backward + ring.backward)

    def layer_cost(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c, t_fwd, t_bwd, bw_span, lat):
        # no overlap: one all-to-all sends q, k, v to the ranks owning their heads and a second brings the output
        # back (the same for the gradients); then one kernel over U*N tokens for this rank's heads, the largest
        # head share setting the time. With a ring of R > 1 groups (usp) the ring runs over those groups with the
        # K/V heads a Ulysses rank holds: the all-to-alls use the U-span link, the ring the cp-span link
        u = self.heads_split(cp, ulysses)
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

    def buffers(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c):
        n, kv, q = tokens, kv_heads * head_dim, q_heads * head_dim
        u = self.heads_split(cp, ulysses)
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

    def kernel_block(self, cp, ulysses, tokens):
        # the whole sequence (cp*N) when Ulysses spans the group, else a zigzag chunk of the U*N-token group
        u = self.heads_split(cp, ulysses)
        return tokens * cp if u == cp else max(1, u * tokens // 2)

    def factorings(self, cp, q_heads, pinned):
        return [None] if cp <= q_heads else []


register(Ulysses())
