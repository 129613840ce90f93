"""Bytes one rank sends per attention call, for each CP strategy: the communication term for the planner.

Formulas read off the code paths (ring.py, allgather.py, ulysses.py) for plain causal or bidirectional
attention; windows, chunks and documents can only shorten the ring (pass `ring_steps`,
blocks.ring_steps gives it). tests/dist/test_attention_ulysses.py checks them against the traffic
counted on real gloo ranks (longdoc.bench.traffic). Left out: the agreement checks (a few ints per call).
"Sent" counts what leaves a rank; what a collective does inside (gloo's all-reduce) is modelled as a ring
all-reduce, 2 (P-1) / P of the buffer. Pure arithmetic: no torch.distributed needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.parallel.ulysses import split_heads


@dataclass(frozen=True)
class Traffic:
    forward: int  # bytes this rank sends in the forward pass
    backward: int  # ... and in the backward pass

    @property
    def total(self) -> int:
        return self.forward + self.backward


def _ring(size: int, local_len: int, kv_heads: int, head_dim: int, batch: int, itemsize: int, acc: int,
          steps: int | None) -> Traffic:
    if size == 1:
        return Traffic(0, 0)
    steps = size if steps is None else steps
    kv = 2 * batch * kv_heads * local_len * head_dim  # elements of one K/V block
    # forward: steps - 1 shifts of K/V; backward: K/V again, and the fp32 dK/dV accumulator travels every step
    # (steps - 1 shifts, then home: one more message)
    return Traffic((steps - 1) * kv * itemsize, (steps - 1) * kv * itemsize + (steps if steps > 1 else 0) * kv * acc)


def _ulysses(size: int, rank: int, local_len: int, q_heads: int, kv_heads: int, head_dim: int, batch: int,
             itemsize: int) -> tuple[Traffic, int]:
    """(bytes of the two all-to-alls, the K/V heads this rank attends with afterwards)."""
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


def ulysses_traffic(size: int, rank: int, local_len: int, q_heads: int, kv_heads: int, head_dim: int, batch: int,
                    itemsize: int) -> tuple[Traffic, int]:
    """Bytes rank `rank` of a `size`-rank Ulysses group sends in its all-to-alls (forward, backward), and the K/V
    heads it attends with afterwards (what a usp ring carries); the planner's Ulysses term."""
    return _ulysses(size, rank, local_len, q_heads, kv_heads, head_dim, batch, itemsize)


def bytes_sent(strategy: str, *, cp_size: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
               itemsize: int, batch: int = 1, ulysses_size: int | None = None, rank: int = 0,
               ring_steps: int | None = None, backend: str = "gloo") -> Traffic:
    """Bytes CP rank `rank` sends in one attention forward and backward with `strategy`.

    seq_len: the full length (a multiple of the layout's); itemsize: bytes per element of q/k/v (2 for bf16).
    Ulysses ranks may differ (uneven head ranges): ask for each rank, or take the max. For "usp",
    ulysses_size factors cp_size (ring_size = cp_size / ulysses_size).
    """
    local = seq_len // cp_size
    acc = 8 if itemsize == 8 else 4  # the fp32 (fp64) accumulators of dK/dV
    if strategy == "ring":
        return _ring(cp_size, local, kv_heads, head_dim, batch, itemsize, acc, ring_steps)
    if strategy == "allgather":
        if cp_size == 1:
            return Traffic(0, 0)
        kv = 2 * batch * kv_heads * local * head_dim
        gather = (cp_size - 1) * kv * itemsize
        # NCCL reduce-scatters dK/dV; gloo has no reduce-scatter, so it all-reduces all cp_size parts
        scatter = (cp_size - 1) * kv * acc if backend == "nccl" else 2 * (cp_size - 1) * kv * acc
        return Traffic(gather, gather + scatter)
    if strategy in ("ulysses", "usp"):
        u = cp_size if strategy == "ulysses" else ulysses_size
        if u is None or cp_size % u:
            raise ValueError(f"usp needs ulysses_size, a divisor of cp_size {cp_size}; got {ulysses_size!r}")
        a2a, kv_local = _ulysses(u, rank % u, local, q_heads, kv_heads, head_dim, batch, itemsize)
        ring = _ring(cp_size // u, u * local, kv_local, head_dim, batch, itemsize, acc, ring_steps)
        return Traffic(a2a.forward + ring.forward, a2a.backward + ring.backward)
    raise ValueError(f"strategy must be one of 'ring', 'allgather', 'ulysses', 'usp', got {strategy!r}")
