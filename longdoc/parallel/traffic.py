"""Bytes one rank sends per attention call: `bytes_sent` asks the strategy (longdoc.parallel.strategies/), and the
pieces the strategies build theirs from (a ring's rotation, a Ulysses all-to-all) live here.

Formulas read off the code paths (ring.py, allgather.py, ulysses.py) for plain causal or bidirectional
attention; windows, chunks and documents can only shorten the ring (pass `ring_steps`,
blocks.ring_steps gives it). tests/dist/test_parallel_attention_ulysses.py checks them against the traffic
counted on real gloo ranks (longdoc.bench.traffic). Left out: the agreement checks (a few ints per call).
"Sent" counts what leaves a rank; what a collective does inside (gloo's all-reduce) is modelled as a ring
all-reduce, 2 (P-1) / P of the buffer. Pure arithmetic: no torch.distributed needed.
"""

from __future__ import annotations

from longdoc.parallel.strategy import Traffic, get
from longdoc.parallel.ulysses import split_heads


def ring_traffic(size: int, local_len: int, kv_heads: int, head_dim: int, batch: int, itemsize: int,
                 steps: int | None) -> Traffic:
    """Bytes a rank of a `size`-rank ring sends rotating K/V blocks of `local_len` tokens (forward, backward);
    `steps` < size where a pattern shortens the ring."""
    if size == 1:
        return Traffic(0, 0)
    acc = accumulator_bytes(itemsize)
    steps = size if steps is None else steps
    kv = 2 * batch * kv_heads * local_len * head_dim  # elements of one K/V block
    # forward: steps - 1 shifts of K/V; backward: K/V again, and the fp32 dK/dV accumulator travels every step
    # (steps - 1 shifts, then home: one more message)
    return Traffic((steps - 1) * kv * itemsize, (steps - 1) * kv * itemsize + (steps if steps > 1 else 0) * kv * acc)


def accumulator_bytes(itemsize: int) -> int:
    """Bytes per element of the dK/dV accumulators: fp32, or fp64 for float64 inputs."""
    return 8 if itemsize == 8 else 4


def ulysses_traffic(size: int, rank: int, local_len: int, q_heads: int, kv_heads: int, head_dim: int, batch: int,
                    itemsize: int) -> tuple[Traffic, int]:
    """Bytes rank `rank` of a `size`-rank Ulysses group sends in its all-to-alls (forward, backward), and the K/V
    heads it attends with afterwards (what a usp ring carries); the planner's Ulysses term."""
    heads = split_heads(q_heads, kv_heads, size)
    wq = [b - a for a, b in heads.q]
    wkv = [b - a for a, b in heads.kv]
    token = batch * local_len * head_dim * itemsize  # bytes of one head of this rank's tokens
    others = [j for j in range(size) if j != rank]
    qkv_out = sum(wq[j] + 2 * wkv[j] for j in others) * token  # q, k, v to the ranks owning those heads
    back = (size - 1) * wq[rank] * token  # this rank's heads of the output, to every token owner
    d_in = sum(wq[j] for j in others) * token  # dout
    # dq, dk, dv; a replicated K/V head's partial dK/dV travel in fp32 from half precision (summed, rounded once)
    d_back = (size - 1) * (wq[rank] + 2 * wkv[rank] * (2 if heads.replicated and itemsize == 2 else 1)) * token
    kv_local = wq[rank] if heads.kv_index(rank) is not None else wkv[rank]  # expanded when not plain GQA
    return Traffic(qkv_out + back, d_in + d_back), kv_local


def bytes_sent(strategy: str, *, cp_size: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
               itemsize: int, batch: int = 1, ulysses_size: int | None = None, rank: int = 0,
               ring_steps: int | None = None, backend: str = "gloo") -> Traffic:
    """Bytes CP rank `rank` sends in one attention forward and backward with `strategy`.

    seq_len: the full length (a multiple of the layout's); itemsize: bytes per element of q/k/v (2 for bf16).
    Ulysses ranks may differ (uneven head ranges): ask for each rank, or take the max. For "usp",
    ulysses_size factors cp_size (ring_size = cp_size / ulysses_size).
    """
    return get(strategy).bytes_sent(cp_size=cp_size, local_len=seq_len // cp_size, q_heads=q_heads,
                                    kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, batch=batch,
                                    ulysses_size=ulysses_size, rank=rank, ring_steps=ring_steps, backend=backend)
