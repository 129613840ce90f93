"""What a decoder layer of each kind saves for its backward, per rank: Mamba2 (SSD) and Gated DeltaNet mixers under
state passing, MoE experts, DeepSeek's latent attention (MLA) and its sparse indexer (DSA).

A Llama-style layer is A*N (longdoc.plan.activations); a layer of another kind keeps A's norms (with the outputs its
first linears read) and replaces A's "attention" part by its mixer's terms and A's "mlp" part by its MLP's. Every
term is a tensor the code saves for backward, each storage once, as saved-tensor hooks count them:
tests/unit/test_plan_kinds.py checks the sums against docs/bench/kinds-2026-12-06.json and against live models at
other shapes, lengths and in bf16. N tokens per rank, c bytes per activation (4 fp32, 2 bf16); the recurrences run
transformers' pure-torch kernels on every device under CP (never a fused kernel), which compute in fp32 whatever c
is. An fp32 model's .float() is no copy, so several tensors are views of a projection there and fp32 copies in bf16.

Pieces (longdoc.parallel.recurrent): a rank runs its tokens as p pieces per row (zigzag 2, contiguous 1) of Lp = N/p
tokens; the kernel chunks a piece into nc chunks of cs tokens (Lq = nc*cs >= Lp, padded) and longdoc corrects the e
pieces that do not start the sequence from their entering states (the worst rank: zigzag e = 2 at cp > 1, 1 at
cp = 1; contiguous 1 at cp > 1). A rank keeps its own pieces' summaries only (its backward gathers the others'
again), so no term grows with cp. One document per row: packed rows run more pieces (not modelled).

Mamba2 (SSD; H heads x P dims = d channels, state n, G groups, conv kernel K, cdim = d + 2Gn):
  outside the scan  the conv input with a halo of K-1 tokens per piece cdim*(N + p(K-1))*c, its output
                    cdim*(N + (p+1)(K-1))*c, the keep index 8N; x/B/C after the conv cdim*N*c (bf16: the scan's fp32
                    copy of x, 4dN); the gated norm's gate, in_proj's whole output N*(2d + 2Gn + H)*c (bf16: its fp32
                    copy, 4dN), 4 fp32 tensors of d (scan output, silu(z), product, normalised) + rsqrt 4GN;
                    out_proj's input cdN
  per piece (fp32)  4 x (Lq*d) (x padded, x twice re-laid for the einsums, C.states) + 5 x (Lq*H*n) (B and C for
                    the einsums) + 3 x (Lq*H*cs) (the chunk-local decay L, G = C.B, M = G*L) + the chunk states
                    (2nc + 1)*H*P*n; dt per step 32*Lp*H (bf16: (4c + 20)*Lp*H: the softplus / clamp inputs in c,
                    fp32 copies for the scan and the summary's log-decay)
  per corrected     Lp*H*(16, bf16 2c + 8) (the piece's decay) + 4*(Lp*H*n (C) + Lp*d (C.S_in) + H*P*n (S_in))
  summaries         p*H*(P*n + 1)*4 (log T, U of each own piece)
Gated DeltaNet (Hk key heads, Hv value heads, dk, dv, cs = 64; longdoc runs the kernel on values augmented by dk
identity columns, dv' = dv + dk; cdim = 2*Hk*dk + Hv*dv):
  outside the scan  the conv input, output and keep index as Mamba2's; beta (sigmoid) cHvN; the decay's softplus
                    input and output 8HvN; the gated norm with out_proj's input N*Hv*dv*(12 + 3c) + 4HvN (the scan
                    output, normalised, the gate, gated, silu(gate), the output). With Hk = Hv in fp32, q and k reach
                    the kernel's l2 norm as views of the conv output (+cdim*N*c, and no per-piece copies) and the
                    gate as a view of in_proj_qkvz's output (+N*(2*Hk*dk + Hv*dv)*c)
  per piece (fp32)  2 x (Lp*Hv*dk) (q and k into their l2 norm) + 10 x (Lq*Hv*dk) (normalised k, the chunk matmuls'
                    copies of k*beta, k, q and k, k*beta, q, the UT-solved keys, the decayed q and k; 6 when the
                    piece is padded to the chunk: F.pad's copies are contiguous, and the matmuls take views)
                    + 2 x (Lq*Hv*dv') (v with beta, the UT-solved values) + 5 x (Lq*Hv*cs) (pairwise decays, the
                    k.k and q.k products, the UT system, the intra-chunk attention) + 6 x (Lq*Hv) + per chunk the
                    state and its new values nc*Hv*dv'*(dk + cs)
  per corrected     the kernel's output (its reads r_t correct it) Lq*Hv*dv' + S_in Hv*dk*dv, fp32
  summaries         p*Hv*dk*(dk + dv)*4 (T, U of each own piece)
MoE (E experts, top-k, expert width Ie, shared width Is; S = k*N routed copies; transformers' grouped_mm experts):
  router            softmax: N*(4E + 8k) (+ 4N(1 + k) renormalised); top-k then softmax (Granite): 12kN; DeepSeek's
                    grouped sigmoid: N*(5E + 16*groups + 8*kept groups + 8k) (+ 4N(1 + k)) (+ its fp32 input 4hN
                    in bf16)
  experts           S*(2ch + 4c*Ie + 28) + 4E: the gathered inputs and the down outputs, gate/up, act and product,
                    three int64 orderings and the routing weights (GPT-OSS's clamped SwiGLU keeps 7c*Ie, and its
                    biases' index 8 more); under CPU autocast grouped_mm is no autocast op and computes in the fp32
                    weights' dtype (c = 4 here)
  shared            4c*Is*N (a dense MLP), + N*c(h + 1) for a sigmoid-gated shared expert
  tiled (longdoc.hf.tiled_mlp): the router as above, and the tiles' stash of the routing 12kN (not measured)
MLA (per token): the q norm 4*ql + 4 + 2c*ql; the kv norm's fp32 input (fp32: the whole kv_a output (kvl + rope)*4;
  bf16: a 4*kvl copy) + 4 + 2c*kvl; q, k and the output at one head width w = max(nope + rope, v_dim) 3cHw, v cHw
  where it is padded to w, else the kv_b_proj output it is a view of, cH(nope + v_dim); 4H (lse); cH*v_dim (o_proj).
DSA: each layer keeps its indexer's int32 top-k key indices, 4*N*min(index_topk, L). The indexer runs under no_grad:
  its keys and scores are forward temporaries (memory.estimate), never saved.
Gated attention (Qwen3-Next): the sigmoid output gate keeps the output and the gate, 2cq per token; in fp32 the q
  norm's input is a view of q_proj's output, query and gate together (+cq).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longdoc.plan.shapes import ModelShape

# longdoc.hf.kinds.dsa.SCORE_ELEMENTS (the indexer's per-tile score budget; tested equal, not imported: the planner
# imports no transformers integration) and longdoc.parallel.selection.MASK_ELEMENTS (the selected-key mask tile)
DSA_SCORE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Pieces:
    """How a rank's tokens run through a state-passing mixer: per row, `per_row` pieces of `length` tokens,
    `entered` of them corrected from another piece's state (the worst rank)."""

    rows: int
    per_row: int
    length: int
    entered: int

    @classmethod
    def of(cls, layout: str, cp: int, padded_len: int, rows: int) -> Pieces:
        per_row = 2 if layout == "zigzag" else 1
        entered = (min(2, 2 * cp - 1) if layout == "zigzag" else min(1, cp - 1))
        return cls(rows=rows, per_row=per_row, length=padded_len // cp // per_row, entered=entered)

    @property
    def count(self) -> int:
        return self.rows * self.per_row


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _conv(conv_dim: int, kernel: int, n: int, pc: Pieces, c: int) -> float:
    """The causal conv under CP: its input with a halo of K-1 tokens per piece, its output (one conv over the
    concatenated pieces, K-1 longer), and the index that keeps the rank's own tokens."""
    halo = kernel - 1
    return conv_dim * (n + pc.count * halo) * c + conv_dim * (n + (pc.count + pc.rows) * halo) * c + 8 * n


def mamba2_bytes(shape: ModelShape, n: int, pc: Pieces, c: int) -> float:
    """Saved bytes of one Mamba2 mixer on N tokens (the module docstring), its in_proj's input excluded."""
    m = shape.mamba2
    h_, p_, s_, g_, d = m.heads, m.head_dim, m.state, m.groups, m.inner
    fp32 = c == 4  # an fp32 model's .float() is no copy: the scan and the norm keep views of the projections
    outside = _conv(m.conv_dim, m.conv_kernel, n, pc, c)
    outside += m.conv_dim * n * c if fp32 else 4 * d * n  # x/B/C after the conv, or the scan's fp32 copy of x
    outside += (n * m.proj * c if fp32 else 4 * d * n)  # the norm's gate: in_proj's output, or its fp32 copy
    outside += 4 * 4 * d * n + 4 * g_ * n + c * d * n + 2 * 4 * h_
    lq = _ceil(pc.length, m.chunk) * m.chunk
    nc = lq // m.chunk
    # dt per step: the scan's softplus / clamp inputs and fp32 dt, the two decays, the summary's log-decay
    dt = 32 * pc.length * h_ if fp32 else (4 * c + 20) * pc.length * h_
    piece = dt + 4 * (4 * lq * d + 5 * lq * h_ * s_ + 3 * lq * h_ * m.chunk + (2 * nc + 1) * h_ * p_ * s_)
    piece += 2 * m.chunk**2 + 2 * (nc + 1) ** 2 + 4 * h_ * (nc + 1) ** 2 + 4 * h_
    corrected = (16 if fp32 else 2 * c + 8) * pc.length * h_ + 4 * (pc.length * h_ * s_ + pc.length * d + h_ * p_ * s_)
    summaries = 4 * h_ * (p_ * s_ + 1)
    return outside + pc.count * (piece + summaries) + pc.rows * pc.entered * corrected


def delta_bytes(shape: ModelShape, n: int, pc: Pieces, c: int) -> float:
    """Saved bytes of one Gated DeltaNet mixer on N tokens (the module docstring), its in_proj's input excluded."""
    g = shape.delta
    hv, dk, dv, cs = g.v_heads, g.k_dim, g.v_dim, g.chunk
    dva = dv + dk  # the augmented values: the state passing's identity columns
    vd = hv * dv
    # one value head per key head, in fp32: q and k reach the kernel's l2 norm as views of the conv's output (no
    # repeat, no cast), and the norm's gate z as a view of in_proj_qkvz's output (its reshape needs no copy)
    views = g.k_heads == hv and c == 4
    outside = _conv(g.conv_dim, g.conv_kernel, n, pc, c) + c * hv * n + 8 * hv * n + 2 * 4 * hv
    outside += n * vd * (12 + 3 * c) + 4 * hv * n  # the gated norm, out_proj's input included
    if views:
        outside += g.conv_dim * n * c + n * (2 * g.k_heads * dk + vd) * c  # the conv output; qkvz beyond z
    lq = _ceil(pc.length, cs) * cs
    nc = lq // cs
    # q and k reach the kernel transposed (not contiguous): its chunk matmuls copy k*beta, k, q and k again, and two
    # products keep k*beta and q; a piece padded to the chunk is contiguous (F.pad copies), and those are views
    re_laid = 10 if lq == pc.length else 6
    piece = 4 * ((0 if views else 2 * pc.length * hv * dk) + re_laid * lq * hv * dk + 2 * lq * hv * dva
                 + 5 * lq * hv * cs + 6 * lq * hv + nc * hv * dva * (dk + cs) + hv * nc)
    piece += cs * cs
    corrected = 4 * (lq * hv * dva + hv * dk * dv)
    summaries = 4 * hv * dk * (dk + dv)
    return outside + pc.count * (piece + summaries) + pc.rows * pc.entered * corrected


def moe_bytes(shape: ModelShape, n: int, c: int, tiled: bool = False, autocast: bool = False) -> float:
    """Saved bytes of one MoE MLP on N tokens: router, routed experts (k copies of each token), shared experts."""
    e = shape.experts
    k, E = e.top_k, e.experts
    renorm = 4 * n * (1 + k) if e.renorm else 0
    if e.router == "topk_softmax":
        router = 12 * k * n
    elif e.router == "sigmoid_group":  # scores, the groups' top-2 and kept groups, the expert mask, the top-k
        router = n * (5 * E + 16 * e.groups + 8 * e.topk_groups + 8 * k) + renorm
        router += 4 * shape.hidden * n if c < 4 else 0  # it scores in fp32: a copy of its input
    else:
        router = n * (4 * E + 8 * k) + renorm
    if tiled:
        return router + 12 * k * n  # the experts' tiles stash the routing; their input is the norm's output
    ce = 4 if autocast else c  # grouped_mm is no autocast op: it computes in the (fp32) weights' dtype
    experts = k * n * (2 * ce * shape.hidden + (2 + e.act_saves) * ce * e.width + 28 + (8 if e.biased else 0)) + 4 * E
    shared = 4 * c * e.shared * n + (n * c * (shape.hidden + 1) if e.shared_gate else 0)
    return router + experts + shared


def mla_bytes_per_token(shape: ModelShape, c: int) -> float:
    """Saved bytes per token of one MLA attention (the module docstring), its q_a/kv_a projections' input
    excluded (the norm's output, in A's norms)."""
    m, hd = shape.mla, shape.heads
    q = 0 if m.q_lora is None else 4 * m.q_lora + 4 + 2 * c * m.q_lora
    kv_in = (m.kv_lora + m.rope) * c if c == 4 else 4 * m.kv_lora
    kv = kv_in + 4 + 2 * c * m.kv_lora
    qk = m.nope + m.rope
    w = max(qk, m.v_dim)
    # v is a view of kv_b_proj's output (k_nope and v) unless it is padded up to the q/k width
    v = w if m.v_dim < qk else m.nope + m.v_dim
    return q + kv + c * hd * (3 * w + v) + 4 * hd + c * hd * m.v_dim


def attention_extra_per_token(shape: ModelShape, c: int) -> float:
    """What a gated attention (Qwen3-Next) keeps beyond A's attention part, per token."""
    if not shape.attn_gate:
        return 0.0
    return 2 * c * shape.q + (c * shape.q if c == 4 and shape.qk_norm else 0)


def dsa_indices(shape: ModelShape, n: int, seq_len: int) -> float:
    """The indexer's int32 top-k key indices, which the attention keeps for its backward."""
    return 4 * n * min(shape.indexer.topk, seq_len) if shape.indexer is not None else 0.0


def dense_shape(shape: ModelShape) -> ModelShape:
    """The shape whose `intermediate` is a MoE model's dense MLP width (its dense layers' A)."""
    if shape.experts is None or not shape.dense_intermediate:
        return shape
    return dataclasses.replace(shape, intermediate=shape.dense_intermediate)


def kind_label(shape: ModelShape, j: int) -> str:
    """Layer j's kind as the plan prints it: "mamba2 + MoE", "MLA attention + DSA + MLP", ..."""
    mixer = shape.mixer(j)
    if mixer == "attention":
        mixer = "MLA attention" if shape.mla is not None else "attention"
        if shape.indexer is not None:
            mixer += " + DSA"
    mlp = shape.mlp(j)
    return mixer if mlp == "none" else f"{mixer} + {'MoE' if mlp == 'moe' else 'MLP'}"


def layer_bytes(shape: ModelShape, j: int, n: int, pc: Pieces, c: int, seq_len: int, parts: dict[str, float],
                dense_parts: dict[str, float], tiled: bool = False, autocast: bool = False) -> float:
    """Bytes decoder layer `j` saves for backward on N tokens: A's norms (and LoRA adapters), its mixer, its MLP.

    parts / dense_parts: `activations.layer_parts_per_token` of the shape, and of its dense MLP width (a MoE model's
    dense layers). A mixer kind the planner does not model is priced as attention (a note of the plan says so)."""
    moe = shape.mlp(j) == "moe" and shape.experts is not None
    p = parts if moe else dense_parts
    none = shape.mlp(j) == "none"  # a pure SSM's block: one norm, no MLP
    total = (p["norms"] / (2 if none else 1) + p["adapters"]) * n
    mixer = shape.mixer(j)
    if mixer == "mamba2" and shape.mamba2 is not None:
        total += mamba2_bytes(shape, n, pc, c)
    elif mixer == "gated_deltanet" and shape.delta is not None:
        total += delta_bytes(shape, n, pc, c)
    else:
        per_token = mla_bytes_per_token(shape, c) if shape.mla is not None else p["attention"]
        total += (per_token + attention_extra_per_token(shape, c)) * n + dsa_indices(shape, n, seq_len)
    return total + (moe_bytes(shape, n, c, tiled, autocast) if moe else 0 if none else p["mlp"] * n)
