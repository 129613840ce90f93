"""A: the bytes one decoder layer saves for its backward per token (the formulas: longdoc.plan.memory's
docstring; under CPU bf16 autocast: longdoc.plan.autocast). Layer kinds other than a Llama-style attention layer
with a dense MLP replace some of these parts: longdoc.plan.layer_activations."""

from __future__ import annotations

from longdoc.plan.autocast import autocast_layer_parts_per_token
from longdoc.plan.shapes import ModelShape

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def layer_bytes_per_token(shape: ModelShape, c: int, lora: bool = False, lora_rank: int = 16,
                          lora_targets: tuple[str, ...] = LORA_TARGETS, autocast: bool = False,
                          tiled_mlp: bool = False) -> float:
    """A: bytes one decoder layer saves for backward per token (see the module docstring).

    tiled_mlp (longdoc.hf.tiled_mlp): the MLP saves only its input (the second norm's output, which the tiled
    backward recomputes from); its gate, up, act and product exist for one tile at a time (`memory.estimate`).
    """
    return sum(layer_parts_per_token(shape, c, lora, lora_rank, lora_targets, autocast, tiled_mlp).values())


def layer_parts_per_token(shape: ModelShape, c: int, lora: bool = False, lora_rank: int = 16,
                          lora_targets: tuple[str, ...] = LORA_TARGETS, autocast: bool = False,
                          tiled_mlp: bool = False) -> dict[str, float]:
    """A split into "norms" (the two norms, with the outputs the next linears read), "attention" (q/k/v and their
    norms, the output, its lse, o_proj's input), "mlp" and "adapters" (LoRA's rank-r intermediates)."""
    if autocast:
        return autocast_layer_parts_per_token(shape, c, lora, lora_rank, lora_targets, tiled_mlp)
    h, q, kv, i, nh = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.heads
    attn = c * (3 * q + 2 * kv) + 4 * nh
    if shape.fused_qkv:
        attn += c * (q + kv)  # v is a view of the fused qkv output, which it keeps alive whole
    cn = 4 if shape.norm_fp32 else c  # the bytes of a norm's normalised x (fp32 where it scales before the cast)
    qk = (4 * (q + kv) + 4 * (nh + shape.kv_heads) + cn * (q + kv)) if shape.qk_norm else 0
    # RMSNorm: fp32 input, rsqrt, normed, output; LayerNorm: input, mean, rstd, output.
    norm_base, norm_out = ((c * h + 8, c * h) if shape.layernorm else (4 * h + 4, c * h))
    normed = 0 if shape.layernorm else cn * h
    if not lora:
        return {"norms": 2 * (norm_base + normed + norm_out), "attention": attn + qk,
                "mlp": 0 if tiled_mlp else 4 * c * i, "adapters": 0}
    # Frozen weights: a frozen linear keeps no input, a norm with a frozen weight keeps no normed copy.
    # What the adapters read is kept: the attention norm's output (q/k/v adapters), the o_proj input (in
    # `attn`), and each adapter's rank-r intermediate. The MLP keeps gate, up and act for the gradient that
    # flows to earlier layers, but not the product (down_proj is frozen).
    targets = set(lora_targets)
    norms = 2 * norm_base + (norm_out if {"q_proj", "k_proj", "v_proj"} & targets else 0)
    mlp = 3 * c * i + (c * h if {"gate_proj", "up_proj"} & targets else 0) + (c * i if "down_proj" in targets else 0)
    if tiled_mlp:
        mlp = c * h  # the stashed MLP input
    return {"norms": norms, "attention": attn + qk, "mlp": mlp, "adapters": c * lora_rank * len(lora_targets)}
