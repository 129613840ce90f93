"""Estimated time of one training step per rank: FLOPs, bandwidth, and what overlaps what.

FLOPs per rank (N = B*L/cp tokens, P_mm = parameters used in matmuls, q = heads*head_dim):
  dense forward      2 * N * P_mm                              (lm_head included, embedding lookup not)
  dense backward     2 x forward (inputs and weights); LoRA: 1 x forward (inputs only, base frozen)
  attention forward  2 * B * L^2 * q / cp per layer            (QK^T and PV, 2 flops per multiply-add,
                                                                causal half; zigzag gives every rank the same
                                                                share; contiguous: the last rank does (2cp-1)/cp x)
  attention backward 2.5 x forward                              (flash backward: 5 matmuls to the forward's 2)
  recompute          full activation checkpointing runs every layer's forward again in the backward;
                     the chunked loss recomputes its lm_head forward: + 2 * N * V * h
Time of compute = FLOPs / (peak * efficiency), with the efficiencies of `hardware.Assumptions`; attention
also x b / (b + knee) for query blocks of b tokens (`hardware.Device.attention_knee_tokens`, strategies.py).

Communication (bandwidth b of the group's link, see hardware.link_gbps, x link efficiency):
  CP attention, per layer and pass: each strategy's own `layer_cost` (longdoc/parallel/strategies/, one module
    each, looked up through longdoc/plan/strategies.py): the ring overlaps its K/V steps with the compute,
    all-gather and the Ulysses all-to-alls do not, usp's outer ring overlaps like the ring. Under checkpointing
    the recomputed forward runs it again.
  FSDP2, per layer: all-gather P_l*c*(S-1)/S (forward, and again in the backward), reduce-scatter of
    fp32 gradients P_l*4*(S-1)/S, prefetched: a layer takes max(its compute, its collectives).
  DDP (no FSDP): all-reduce 2*P_t*4*(W-1)/W, overlapped with the backward.
  optimizer: AdamW reads and writes 28 bytes per trainable parameter (of its shard) at HBM speed.
  checkpoint offload (GPU): each layer's checkpoint N*h*c goes to host memory in the forward and comes back in
    the backward on a side stream, overlapped with the layer: a layer takes max(its compute, N*h*c / host link).
  tiled MLP: with checkpointing the tiled backward's recompute replaces the checkpoint's MLP recompute (no extra
    FLOPs); without it, the MLP's forward runs once more: + 2*N*P_mlp per layer.
  layer kinds: only attention layers (ModelShape.attention_layers) have the L^2 attention and its CP
    communication; a Mamba2 / Gated DeltaNet layer costs its projections (in P_mm) and its scan, whose FLOPs
    (linear in N) are not counted. A MoE layer's tokens pass k of its E experts: the dense FLOPs count the layers'
    parameters less the (E - k) gated experts (3*h*I_e each) a token does not visit. DSA's attention is priced as
    dense causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.plan import strategies
from longdoc.plan.hardware import Assumptions, link_gbps
from longdoc.plan.memory import Setup


@dataclass
class StepTime:
    flops: dict[str, float]  # per rank
    seconds: dict[str, float]  # compute, exposed communication, optimizer: they add up to `total`
    passes: dict[str, float]  # forward and backward (recompute included), communication overlapped
    comm_bytes: dict[str, float]  # per rank per step
    total: float
    tokens_per_s: float  # whole job: dp * B * L / total
    tokens_per_s_per_device: float


def _active_layer_params(sh) -> float:
    """The decoder layers' parameters a token's matmuls use: all, less the routed experts it does not visit."""
    e = sh.experts
    if e is None:
        return sh.params.layers
    moe_layers = sum(1 for j in range(sh.layers) if sh.mlp(j) == "moe")
    return sh.params.layers - moe_layers * (e.experts - e.top_k) * 3 * sh.hidden * e.width


def estimate_time(s: Setup, interconnect: str = "nvlink", assume: Assumptions | None = None) -> StepTime:
    assume = assume or Assumptions()
    sh, dev, n, c = s.shape, s.dev, s.tokens, s.c
    peak = dev.peak_tflops * 1e12
    mm_rate, attn_rate = (peak, peak) if dev.achieved else (peak * assume.matmul_efficiency,
                                                            peak * assume.attention_efficiency)
    lat = assume.latency_s
    bw_all = link_gbps(dev, interconnect, s.world) * 1e9 * assume.link_efficiency

    p_mm = sh.params.matmul
    rows = s.logit_rows  # the chunked loss computes the lm_head only where a token has a label
    active = _active_layer_params(sh)
    dense_f = 2.0 * n * active + 2.0 * rows * (p_mm - sh.params.layers)
    dense_b = dense_f * (1.0 if s.lora else 2.0)
    layers_f = 2.0 * n * active
    balance = (2 * s.cp - 1) / s.cp if s.layout == "contiguous" and s.cp > 1 else 1.0
    attn_f_layer = 2.0 * s.micro_batch * s.padded_len**2 * sh.q / s.cp * balance
    attn_b_layer = 2.5 * attn_f_layer
    # a tiled MLP without checkpointing recomputes its forward (gated: 3*h*I parameters per token)
    mlp_recompute = 0.0 if s.checkpointing or not s.tiled_mlp else 2.0 * n * 3 * sh.hidden * sh.intermediate * sh.layers
    recompute_dense = ((layers_f if s.checkpointing else 0.0) + mlp_recompute
                       + (2.0 * rows * sh.vocab * sh.hidden if s.loss_chunk else 0.0))
    n_attn = sh.attention_layers  # hybrids: the other layers' mixers have no L^2 attention and no CP ring
    flops = {"dense": dense_f + dense_b, "attention": n_attn * (attn_f_layer + attn_b_layer),
             "recompute": recompute_dense + (n_attn * attn_f_layer if s.checkpointing else 0.0)}

    # Attention per layer with its CP communication: overlapped (ring), or not (all-gather, the all-to-alls)
    # kernel efficiency by block size (ring: small zigzag chunks; Ulysses: one kernel over the sequence)
    keff = strategies.kernel_efficiency(strategies.kernel_block(s.strategy, s.cp, s.ulysses_size, n),
                                        dev.attention_knee_tokens)
    t_af, t_ab = attn_f_layer / (attn_rate * keff), attn_b_layer / (attn_rate * keff)
    layer = strategies.attention_layer(
        s.strategy, cp=s.cp, ulysses=s.ulysses_size, tokens=n, q_heads=sh.heads, kv_heads=sh.kv_heads,
        head_dim=sh.head_dim, c=c, t_fwd=t_af, t_bwd=t_ab, lat=lat,
        bw_span=lambda ranks: link_gbps(dev, interconnect, ranks) * 1e9 * assume.link_efficiency)
    fwd, bwd = layer.forward_s, layer.backward_s
    attn_fwd_s = fwd
    attn_bwd_s = bwd + (fwd if s.checkpointing else 0.0)

    # Dense compute per layer, then FSDP's per-layer collectives overlapped with the whole layer.
    per_layer_dense_f = 2.0 * n * (sh.params.layer if active == sh.params.layers else active / sh.layers) / mm_rate
    per_layer_dense_b = per_layer_dense_f * (1.0 if s.lora else 2.0) + (per_layer_dense_f if s.checkpointing else 0.0)
    per_layer_dense_b += mlp_recompute / sh.layers / mm_rate
    # per layer (forward, backward): attention layers, then the others (no attention, no ring)
    kinds = [(n_attn, per_layer_dense_f + attn_fwd_s, per_layer_dense_b + attn_bwd_s),
             (sh.layers - n_attn, per_layer_dense_f, per_layer_dense_b)]
    comm_bytes = {"cp": n_attn * (layer.forward_bytes * (2 if s.checkpointing else 1) + layer.backward_bytes)}
    if s.offloads:  # the copies run on a side stream beside the layer's compute
        ckpt = n * sh.hidden * c
        copy_s = ckpt / (dev.host_gbps * 1e9 * assume.link_efficiency)
        kinds = [(k, max(f, copy_s), max(b, copy_s)) for k, f, b in kinds]
        comm_bytes["offload"] = 2 * sh.layers * ckpt
    if s.uses_fsdp:
        frac = (s.shards - 1) / s.shards
        ag = sh.params.layer * c * frac / bw_all + lat
        rs = sh.params.layer * 4 * frac / bw_all + lat
        body_f, body_b = (sum(k * max(f, ag) for k, f, _ in kinds), sum(k * max(b, ag + rs) for k, _, b in kinds))
        comm_bytes["fsdp"] = sh.params.total * frac * (2 * c + 4)
    else:
        body_f, body_b = sum(k * f for k, f, _ in kinds), sum(k * b for k, _, b in kinds)
        if s.uses_ddp:
            allreduce = 2 * s.trainable * 4 * (s.world - 1) / s.world
            comm_bytes["ddp"] = allreduce
            body_b = max(body_b, allreduce / bw_all)
    head_f = 2.0 * rows * (p_mm - sh.params.layers) / mm_rate
    head_b = head_f * (1.0 if s.lora else 2.0) + (head_f if s.loss_chunk else 0.0)
    optimizer = 28.0 * s.trainable / s.shards / (dev.hbm_gbps * 1e9)
    passes = {"forward": body_f + head_f, "backward": body_b + head_b}
    total = passes["forward"] + passes["backward"] + optimizer
    # Ulysses: the rank with the largest share of uneven query heads sets the attention time (compute, not comm)
    bal = strategies.head_balance(sh.heads, sh.kv_heads, strategies.ulysses_size(s.strategy, s.cp, s.ulysses_size))
    compute = (flops["dense"] + recompute_dense) / mm_rate + (flops["attention"] + flops["recompute"]
                                                              - recompute_dense) / attn_rate * bal / keff
    seconds = {"compute": compute, "exposed_comm": max(0.0, total - optimizer - compute), "optimizer": optimizer}
    tokens = s.dp * s.micro_batch * s.seq_len
    return StepTime(flops=flops, seconds=seconds, passes=passes, comm_bytes=comm_bytes, total=total,
                    tokens_per_s=tokens / total, tokens_per_s_per_device=tokens / total / s.world)
