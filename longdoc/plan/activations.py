"""A: the bytes one decoder layer saves for its backward per token (the formulas: longdoc.plan.memory's
docstring; under CPU bf16 autocast: longdoc.plan.autocast)."""

from __future__ import annotations

from longdoc.plan.autocast import autocast_layer_bytes_per_token
from longdoc.plan.shapes import ModelShape

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def layer_bytes_per_token(shape: ModelShape, c: int, lora: bool = False, lora_rank: int = 16,
                          lora_targets: tuple[str, ...] = LORA_TARGETS, autocast: bool = False,
                          tiled_mlp: bool = False) -> float:
    """A: bytes one decoder layer saves for backward per token (see the module docstring).

    tiled_mlp (longdoc.hf.tiled_mlp): the MLP saves only its input (the second norm's output, which the tiled
    backward recomputes from); its gate, up, act and product exist for one tile at a time (`memory.estimate`).
    """
    if autocast:
        return autocast_layer_bytes_per_token(shape, c, lora, lora_rank, lora_targets, tiled_mlp)
    h, q, kv, i, nh = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.heads
    attn = c * (3 * q + 2 * kv) + 4 * nh
    if shape.fused_qkv:
        attn += c * (q + kv)  # v is a view of the fused qkv output, which it keeps alive whole
    qk = (4 * (q + kv) + 4 * (nh + shape.kv_heads) + c * (q + kv)) if shape.qk_norm else 0
    # RMSNorm: fp32 input, rsqrt, normed, output; LayerNorm: input, mean, rstd, output.
    norm_base, norm_out = ((c * h + 8, c * h) if shape.layernorm else (4 * h + 4, c * h))
    normed = 0 if shape.layernorm else c * h
    if not lora:
        return 2 * (norm_base + normed + norm_out) + attn + qk + (0 if tiled_mlp else 4 * c * i)
    # Frozen weights: a frozen linear keeps no input, a norm with a frozen weight keeps no normed copy.
    # What the adapters read is kept: the attention norm's output (q/k/v adapters), the o_proj input (in
    # `attn`), and each adapter's rank-r intermediate. The MLP keeps gate, up and act for the gradient that
    # flows to earlier layers, but not the product (down_proj is frozen).
    targets = set(lora_targets)
    norms = 2 * norm_base + (norm_out if {"q_proj", "k_proj", "v_proj"} & targets else 0)
    mlp = 3 * c * i + (c * h if {"gate_proj", "up_proj"} & targets else 0) + (c * i if "down_proj" in targets else 0)
    if tiled_mlp:
        mlp = c * h  # the stashed MLP input
    return norms + attn + qk + mlp + c * lora_rank * len(lora_targets)
