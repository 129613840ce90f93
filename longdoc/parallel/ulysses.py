"""Ulysses attention (DeepSpeed-Ulysses) and the 2-D Ulysses x ring composition (USP).

Ulysses: one all-to-all re-shards q, k, v from tokens to heads. Each of the U ranks of a Ulysses group then
holds the group's whole sequence for its share of the heads, in global token order, and runs ordinary
attention on it with the existing kernels and block plans (one big block for plain causal attention). A
second all-to-all shards the output back to tokens; backward does the same with dout and the gradients.
- strategy "ulysses": the Ulysses group is the whole CP group (ring_size 1), the sequence the full one.
- strategy "usp": the CP group is factored as ring_size x ulysses_size, CP rank = ring_index * ulysses_size +
  ulysses_index (Ulysses on consecutive ranks: inside a node). After the all-to-all the group's tokens go
  round the zigzag ring (ring.py) over the ring axis, for this rank's heads only.

The layouts need nothing new. The P-way zigzag layout read over U consecutive ranks IS the R-way zigzag
layout (R = P / U) with every chunk cut into U pieces: ranks rU..rU+U-1 hold chunks rU+u and 2P-1-rU-u of 2P,
which are chunks r and 2R-1-r of 2R; the same holds for contiguous. Packed rows (per-document zigzag) are not
so regular, so there the ring plans with the group's own pieces (`Tokens.ring_runs`).

Heads. Query heads are cut into U contiguous ranges as even as possible (sizes differ by at most one), so
q_heads need not divide by U: SmolLM2's 9 heads go 4 + 5 over 2 ranks and 2 + 2 + 2 + 3 over 4. That is
exact and sends no padding; the price is balance, the largest range sets the time (ceil(H/U) / (H/U): 1.11
for 9 heads over 2 ranks, 1.33 over 4). Fewer query heads than U is refused by name (api.py). Each rank
receives exactly the K/V heads its query heads read (head h reads K/V head h // (q_heads / kv_heads)):
- kv_heads a multiple of U: a plain split, nothing replicated;
- fewer K/V heads (GQA/MQA with kv_heads < U): a K/V head goes to every rank that reads it, the cheapest exact
  rule (no rank receives a head it does not read); in backward the owner sums the partial dK/dV of such a
  replicated head in fp32 (in half precision they travel in fp32 too, so the sum is rounded once);
- a query range that does not start on a K/V group boundary (9 heads / 3 K/V heads over 2 ranks): after the
  all-to-all the local K/V heads are expanded to one per query head (a local copy, nothing more is sent, but
  under usp the expanded K/V is what goes round the ring); the gradient is summed back.

bf16 / fp16 (as accurate as one device: docs/concepts.md): the backward kernel gets K/V expanded to one head per
query head and each GQA group's dK/dV is summed in fp32 (`_fp32_groups`); dK/dV still to be summed (replicated or
expanded heads) stay fp32 until that sum; the sinks gradient reads the fp32 output.

Sinks (GPT-OSS): a rank folds only its own heads' sinks into its merged (out, lse), once; its sinks gradient is
zero for the other heads, so summed over the CP group it is the full gradient, as for the ring.

When each strategy wins. Bytes a rank SENDS per attention forward + backward (longdoc.parallel.traffic has the
exact formulas, checked against counted traffic by tests/dist/test_parallel_attention_ulysses.py; timings are
`longdoc bench attention`; the rest of this paragraph is formulas, not measurements). L = N / P local tokens,
kv = 2 * kv_heads * head_dim, q = o = q_heads * head_dim elements per token:
  ring        (P-1) L kv  forward, (P-1) L kv + P L kv (fp32 dK/dV) backward   ~ 3 N kv: O(N), whatever P
  all-gather  the same K/V once per pass, plus a reduce-scatter of dK/dV          O(N), full K/V held per layer
  ulysses     (P-1)/P L (q + kv + o) forward, the same backward (replicated K/V heads' dK/dV in fp32)  O(N / P)
  usp         ulysses over U ranks on U L tokens, then the ring over R = P / U on U L tokens for ~H/U heads
Ulysses moves less per rank as P grows and keeps one large kernel per rank, but every rank sends to every
other one (an all-to-all wants fast links, i.e. one node), it carries q and o too (with few K/V heads the ring's
constant is small: compare per model), and P is capped by the query heads. The ring's point-to-point traffic
overlaps with compute and crosses slow links well. usp puts each where it wins.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import Any

import torch

from longdoc.parallel import blocks, comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.blocks import Runs
from longdoc.parallel.comm import Ring
from longdoc.parallel.guard import Guard
from longdoc.parallel.kernels import Kernel, lse_dtype
from longdoc.parallel.layout import Packed, Run
from longdoc.parallel.masks import Pattern
from longdoc.parallel.ring import ring_backward, ring_forward

Range = tuple[int, int]  # [start, end) of heads


@dataclass(frozen=True)
class Heads:
    """The query and K/V heads each rank of a Ulysses group holds after the all-to-all (see the module doc)."""

    q: tuple[Range, ...]
    kv: tuple[Range, ...]
    group: int  # query heads per K/V head

    @property
    def replicated(self) -> bool:
        """Does some K/V head go to more than one rank (its gradient is then a sum)?"""
        return any(a < prev_end for (_, prev_end), (a, _) in zip(self.kv, self.kv[1:]))

    def kv_index(self, rank: int) -> tuple[int, ...] | None:
        """The local K/V head of each local query head of `rank`, or None when that is the standard grouping
        (query head i reads K/V head i // (local q heads / local K/V heads)) the kernels do by themselves."""
        (a, b), (ka, kb) = self.q[rank], self.kv[rank]
        idx = tuple(h // self.group - ka for h in range(a, b))
        nq, nk = b - a, kb - ka
        if nq % nk == 0 and idx == tuple(i // (nq // nk) for i in range(nq)):
            return None
        return idx


@functools.lru_cache(maxsize=256)
def split_heads(q_heads: int, kv_heads: int, size: int) -> Heads:
    """Contiguous query-head ranges as even as possible over `size` ranks, and the K/V heads each one reads."""
    q = tuple((u * q_heads // size, (u + 1) * q_heads // size) for u in range(size))
    group = q_heads // kv_heads
    return Heads(q, tuple((a // group, (b - 1) // group + 1) for a, b in q), group)


@dataclass(frozen=True)
class Grid:
    """This rank's place in a CP group factored as ring_size x ulysses_size: CP rank = ring_rank * size + rank."""

    group: Any  # the Ulysses process group (torch.distributed ProcessGroup); None when size == 1
    rank: int  # in the Ulysses group
    size: int  # ulysses_size
    ring: Ring | None  # the ring over the ring axis; None when ring_size == 1
    ring_rank: int
    ring_size: int
    layout: str
    timeout: datetime.timedelta | None = None
    guard: Guard | None = None  # the debug check of the Ulysses group's collectives (longdoc.parallel.guard)


@dataclass(frozen=True)
class Tokens:
    """Where a Ulysses group's tokens are, as a pure function of metadata every rank holds."""

    members: tuple[tuple[Run, ...], ...]  # each member's pieces of the full sequence (global), member order
    local: tuple[tuple[Run, ...], ...]  # the same pieces as (offset, length) in the group's global-order tensor
    ring_runs: Runs | None  # every ring rank's pieces, where they are not the layout's over ring_size


def _coalesced(runs_: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for s, n in sorted(runs_):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def token_map(layout: str, ring_size: int, size: int, ring_rank: int, seq_len: int,
              documents: Packed | None = None) -> Tokens:
    """The token pieces of the Ulysses group `ring_rank` of a CP group of ring_size x size ranks."""
    cp_size = ring_size * size

    def member_runs(ring_index: int) -> tuple[tuple[Run, ...], ...]:
        return tuple(layouts.runs(layout, ring_index * size + u, cp_size, seq_len, documents) for u in range(size))

    members = member_runs(ring_rank)
    ordered = sorted((start, n, u, i) for u, rs in enumerate(members) for i, (start, n) in enumerate(rs))
    local: list[list[Run]] = [[(0, 0)] * len(rs) for rs in members]
    offset = 0
    for _, n, u, i in ordered:
        local[u][i] = (offset, n)
        offset += n
    union = tuple(_coalesced([p for rs in member_runs(r) for p in rs]) for r in range(ring_size))
    as_layout = tuple(_coalesced(list(layouts.runs(layout, r, ring_size, seq_len, documents)))
                      for r in range(ring_size))
    return Tokens(members, tuple(tuple(rs) for rs in local), None if union == as_layout else union)


# ---- the two all-to-alls ----

def _seq_to_heads(tensors: list[torch.Tensor], ranges: list[tuple[Range, ...]], grid: Grid,
                  tokens: Tokens) -> list[torch.Tensor]:
    """(batch, heads, local_len, dim) tensors of this rank's tokens -> (batch, its heads, group_len, dim) over
    the whole group's tokens in global order. All tensors travel in ONE all-to-all."""
    if grid.size == 1:
        return tensors
    b, _, n, d = tensors[0].shape
    widths = [[e - a for a, e in r] for r in ranges]  # per tensor, per rank
    send_splits = [sum(b * w[j] * n * d for w in widths) for j in range(grid.size)]
    buf = tensors[0].new_empty(sum(send_splits))
    off = 0
    for j in range(grid.size):
        for t, r, w in zip(tensors, ranges, widths):
            size = b * w[j] * n * d
            buf[off:off + size].view(b, w[j], n, d).copy_(t[:, r[j][0]:r[j][1]])
            off += size
    me = grid.rank
    recv_splits = [sum(b * w[me] * n * d for w in widths)] * grid.size  # every rank sends this rank its heads
    recv = comm.all_to_all(buf, send_splits, recv_splits, grid.group, grid.timeout, grid.guard,
                           "all_to_all ulysses seq->heads")  # every rank sends all heads of its tokens: same bytes
    parts: list[list[torch.Tensor]] = [[] for _ in tensors]
    off = 0
    for _ in range(grid.size):
        for i, w in enumerate(widths):
            size = b * w[me] * n * d
            parts[i].append(recv[off:off + size].view(b, w[me], n, d))
            off += size
    return [layouts.unshard_runs(p, 2, list(tokens.members)) for p in parts]


def _heads_to_seq(tensors: list[torch.Tensor], ranges: list[tuple[Range, ...]], grid: Grid,
                  tokens: Tokens, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Inverse of `_seq_to_heads`: (batch, this rank's heads, group_len, dim) -> (batch, all heads, local_len,
    dim) of this rank's tokens, in `dtype` (default: the first tensor's). Where ranges overlap (a replicated K/V
    head) the contributions are summed in fp32; a tensor handed over in fp32 there travels in fp32 (its bytes
    viewed as pairs of the 2-byte wire dtype), so such a sum is rounded once, on arrival."""
    dtype = dtype or tensors[0].dtype
    if grid.size == 1:
        return [t.to(dtype) for t in tensors]
    wire, sent = tensors[0].dtype, [t.dtype for t in tensors]
    # per tensor: its elements on the wire, (batch, heads, group_len, width in wire elements)
    tensors = [t if t.dtype == wire else t.contiguous().view(wire) for t in tensors]
    b, _, n_group, _ = tensors[0].shape
    dims = [t.shape[-1] for t in tensors]
    n = n_group // grid.size
    me = grid.rank
    widths = [[e - a for a, e in r] for r in ranges]
    send_splits = [sum(b * w[me] * n * d for w, d in zip(widths, dims))] * grid.size
    buf = tensors[0].new_empty(sum(send_splits))
    off = 0
    for j in range(grid.size):
        for t, w, d in zip(tensors, widths, dims):
            size = b * w[me] * n * d
            view, pos = buf[off:off + size].view(b, w[me], n, d), 0
            for start, length in tokens.local[j]:
                view[:, :, pos:pos + length].copy_(t[:, :, start:start + length])
                pos += length
            off += size
    recv_splits = [sum(b * w[s] * n * d for w, d in zip(widths, dims)) for s in range(grid.size)]
    recv = comm.all_to_all(buf, send_splits, recv_splits, grid.group, grid.timeout, grid.guard,
                           "all_to_all ulysses heads->seq",
                           buf.element_size() * sum(recv_splits))  # all heads come back: same bytes on every rank
    total_heads = [r[-1][1] for r in ranges]
    overlap = [any(a < e0 for (_, e0), (a, _) in zip(r, r[1:])) for r in ranges]
    accs = [torch.zeros(b, h, n, d * wire.itemsize // t.itemsize, dtype=lse_dtype(dtype), device=buf.device) if o
            else torch.empty(b, h, n, d * wire.itemsize // t.itemsize, dtype=t, device=buf.device)
            for h, o, d, t in zip(total_heads, overlap, dims, sent)]
    off = 0
    for s in range(grid.size):
        for i, (r, w, d) in enumerate(zip(ranges, widths, dims)):
            size = b * w[s] * n * d
            piece = recv[off:off + size].view(b, w[s], n, d)
            piece = piece if sent[i] == wire else piece.view(sent[i])
            if overlap[i]:
                accs[i][:, r[s][0]:r[s][1]] += piece
            else:
                accs[i][:, r[s][0]:r[s][1]] = piece
            off += size
    return [acc.to(dtype) for acc in accs]


_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=64)
def _fp32_groups(kernel: Kernel | None) -> Kernel | None:
    """`kernel` whose backward sums the dK/dV of each GQA group in fp32, returned unrounded.

    A half-precision kernel handed compact K/V sums the gradients of a group's query heads in its own dtype (aten's
    CPU flash backward rounds to bf16 after every head and every query split: 2-3x the error of one device), while
    one device (transformers repeats K/V on CPU) rounds each head once and sums them in fp32. So the backward sees
    K/V expanded to one head per query head, the group is summed in fp32, and ring_backward adds the fp32 sums to
    its fp32 accumulator and rounds once at the end. The forward is untouched (each query head reads its K/V head
    either way); the expansion is local, after the all-to-all, so nothing more travels."""
    if kernel is None or kernel.name == "math":  # math sums in fp32 already
        return kernel

    def backward(dout, q, k, v, out, lse, causal, scale, **extra):
        g = q.shape[1] // k.shape[1]
        if g == 1:
            return kernel.backward(dout, q, k, v, out, lse, causal, scale, **extra)
        dq, dk, dv = kernel.backward(dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), out, lse,
                                     causal, scale, **extra)
        b, _, n, d = k.shape
        # (batch, kv_heads, group, len, head_dim) -> summed over the group in fp32
        return (dq, dk.reshape(b, -1, g, n, d).sum(2, dtype=torch.float32),
                dv.reshape(b, -1, g, n, d).sum(2, dtype=torch.float32))

    return Kernel(f"{kernel.name}+fp32_groups", kernel.forward, backward, kernel.band, kernel.softcap)


def _expand(kv: torch.Tensor, heads: Heads, rank: int) -> torch.Tensor:
    idx = heads.kv_index(rank)
    return kv if idx is None else kv.index_select(1, torch.tensor(idx, device=kv.device))


def _unexpand(dkv: torch.Tensor, heads: Heads, rank: int) -> torch.Tensor:
    idx = heads.kv_index(rank)
    if idx is None:
        return dkv
    ka, kb = heads.kv[rank]
    acc = torch.zeros(dkv.shape[0], kb - ka, *dkv.shape[2:], dtype=lse_dtype(dkv.dtype), device=dkv.device)
    return acc.index_add_(1, torch.tensor(idx, device=dkv.device), dkv.to(acc.dtype)).to(dkv.dtype)


# ---- forward, backward, the Function, the entry ----

def ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, heads: Heads, tokens: Tokens,
                    causal: bool, scale: float, kernel: Kernel, pattern: Pattern | None = None,
                    band_kernel: Kernel | None = None, sinks: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(out like q, with sinks folded in; the head-sharded (q, k, v, out, lse) that backward needs)."""
    pattern = pattern or Pattern(causal)
    me = grid.rank
    # (batch, heads of this rank, group_len, head_dim), the group's tokens in global order
    q_h, k_h, v_h = _seq_to_heads([q, k, v], [heads.q, heads.kv, heads.kv], grid, tokens)
    out_h, lse_h = ring_forward(q_h, _expand(k_h, heads, me), _expand(v_h, heads, me), grid.ring, grid.layout,
                                pattern.causal, scale, kernel, pattern, band_kernel, tokens.ring_runs,
                                merged=sinks is not None)
    kept = out_h
    if sinks is not None:
        a, b = heads.q[me]
        # folded into the unrounded merge, then rounded once (as one device's softmax with the sink is)
        kept, lse_h = blocks.fold_sinks(out_h, lse_h, sinks[a:b])
        # kept in fp32 for backward: the sinks gradient reads dout . out, which one device takes from unrounded
        # probabilities; the kernels get it rounded, as here
        out_h = kept.to(q.dtype)
    (out,) = _heads_to_seq([out_h], [heads.q], grid, tokens)
    return out, (q_h, k_h, v_h, kept, lse_h)


def ulysses_backward(dout: torch.Tensor, q_h: torch.Tensor, k_h: torch.Tensor, v_h: torch.Tensor,
                     out_h: torch.Tensor, lse_h: torch.Tensor, grid: Grid, heads: Heads, tokens: Tokens,
                     causal: bool, scale: float, kernel: Kernel, pattern: Pattern | None = None,
                     band_kernel: Kernel | None = None, sinks: torch.Tensor | None = None):
    """(dq, dk, dv, dsinks or None) of this rank's tokens from the FINAL head-sharded out (fp32 with sinks) and lse."""
    pattern = pattern or Pattern(causal)
    me = grid.rank
    out_f, out_h = out_h, out_h.to(q_h.dtype)
    (dout_h,) = _seq_to_heads([dout], [heads.q], grid, tokens)
    half = q_h.dtype in _HALF
    if half:
        kernel, band_kernel = _fp32_groups(kernel), _fp32_groups(band_kernel)
    # dK/dV that are summed further (a replicated head's parts on several ranks, expanded heads) stay fp32 until
    # the sum: rounded once, as one device's sum over a group's query heads is
    summed = half and (heads.replicated or heads.kv_index(me) is not None)
    dq_h, dk_h, dv_h = ring_backward(dout_h, q_h, _expand(k_h, heads, me), _expand(v_h, heads, me), out_h, lse_h,
                                     grid.ring, grid.layout, pattern.causal, scale, kernel, pattern, band_kernel,
                                     tokens.ring_runs, dkv_dtype=lse_dtype(q_h.dtype) if summed else None)
    dsinks = None
    if sinks is not None:
        a, b = heads.q[me]
        dsinks = torch.zeros_like(sinks)
        dsinks[a:b] = blocks.sinks_grad(dout_h, out_f, lse_h, sinks[a:b])
    dk_h, dv_h = _unexpand(dk_h, heads, me), _unexpand(dv_h, heads, me)
    if summed and not heads.replicated:  # expanded only: the sum is done, round (the same on every rank)
        dk_h, dv_h = dk_h.to(k_h.dtype), dv_h.to(v_h.dtype)
    dq, dk, dv = _heads_to_seq([dq_h, dk_h, dv_h], [heads.q, heads.kv, heads.kv], grid, tokens)
    return dq, dk, dv, dsinks


class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, grid, pattern, scale, kernel, band_kernel):
        heads = split_heads(q.shape[1], k.shape[1], grid.size)
        seq_len = q.shape[2] * grid.size * grid.ring_size
        tokens = token_map(grid.layout, grid.ring_size, grid.size, grid.ring_rank, seq_len, pattern.documents)
        out, saved = ulysses_forward(q, k, v, grid, heads, tokens, pattern.causal, scale, kernel, pattern,
                                     band_kernel, sinks)
        ctx.save_for_backward(*saved, sinks)
        ctx.args = (grid, heads, tokens, pattern.causal, scale, kernel, pattern, band_kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ulysses_backward(dout.contiguous(), *saved, *ctx.args, sinks=sinks)
        return dq, dk, dv, dsinks, None, None, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid, causal: bool, scale: float,
                      kernel: Kernel, *, pattern: Pattern | None = None, sinks: torch.Tensor | None = None,
                      band_kernel: Kernel | None = None) -> torch.Tensor:
    """Differentiable Ulysses (grid.ring_size 1) or 2-D usp attention on validated local shards."""
    pattern = pattern or Pattern(causal)
    return UlyssesAttention.apply(q, k, v, sinks, grid, pattern, scale, kernel, band_kernel)
