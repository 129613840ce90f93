"""Strategy "allgather": every rank gathers the whole K/V before its kernel and reduce-scatters dK/dV after it;
no overlap, O(full) K/V memory, the fewest kernel calls (longdoc/parallel/allgather.py)."""

from __future__ import annotations

from longdoc.parallel.allgather import allgather_attention
from longdoc.parallel.strategy import LayerComm, Strategy, Traffic, register
from longdoc.parallel.traffic import accumulator_bytes


class AllGather(Strategy):
    name = "allgather"
    order = 1

    def attend(self, q, k, v, cp, causal, scale, kernel, **extra):
        group = cp.group if cp.size > 1 else None
        return allgather_attention(q, k, v, group, cp.timeout, cp.layout, causal, scale, kernel, guard=cp.guard,
                                   **extra)

    def bytes_sent(self, *, cp_size, local_len, q_heads, kv_heads, head_dim, itemsize, batch, ulysses_size, rank,
                   ring_steps, backend):
        if cp_size == 1:
            return Traffic(0, 0)
        kv = 2 * batch * kv_heads * local_len * head_dim
        acc = accumulator_bytes(itemsize)
        gather = (cp_size - 1) * kv * itemsize
        # NCCL reduce-scatters dK/dV; gloo has no reduce-scatter, so it all-reduces all cp_size parts
        scatter = (cp_size - 1) * kv * acc if backend == "nccl" else 2 * (cp_size - 1) * kv * acc
        return Traffic(gather, gather + scatter)

    def layer_cost(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c, t_fwd, t_bwd, bw_span, lat):
        # no overlap: (cp-1) K/V blocks gathered before the kernel, dK/dV reduce-scattered after it
        kv = kv_heads * head_dim
        m_kv, m_dkv = 2.0 * tokens * kv * c, 2.0 * tokens * kv * 4
        bw = bw_span(cp)
        gather, scatter = (cp - 1) * (m_kv / bw + lat), (cp - 1) * (m_dkv / bw + lat)
        return LayerComm(t_fwd + gather, t_bwd + gather + scatter, (cp - 1) * m_kv, (cp - 1) * (m_kv + m_dkv))

    def buffers(self, *, cp, ulysses, tokens, q_heads, kv_heads, head_dim, c):
        n, kv = tokens, kv_heads * head_dim
        full = cp * 2 * n * kv
        return 2 * full * c + 2 * full * 4, f"2*cp*2*N*kv*(c + 4) = 2*{cp}*2*{n:,}*{kv}*({c} + 4)"


register(AllGather())
