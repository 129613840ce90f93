"""Saved activations of one decoder layer under CPU bf16 autocast (fp32 weights), for `memory.layer_bytes_per_token`.

Autocast differs from a bf16 model in what it keeps: the residual stream stays fp32 (fp32 embeddings, fp32
adds), so the norms keep fp32 tensors, and every linear casts its fp32 input to bf16 by itself.
"""

from __future__ import annotations

from longdoc.plan.shapes import ModelShape


def autocast_layer_parts_per_token(shape: ModelShape, c: int, lora: bool, lora_rank: int,
                                   lora_targets: tuple[str, ...], tiled_mlp: bool = False) -> dict[str, float]:
    """A under CPU autocast (fp32 weights, c-byte matmul outputs), counted with saved-tensor hooks in the tests.

    The residual stream is fp32, so both norms run and keep fp32 tensors; their fp32 output is cast to bf16
    by every linear that reads it, separately (autocast caches casts of weights only), and a linear whose
    weight is trained keeps its own copy. Everything after the projections is bf16 as on a GPU.
    A tiled MLP keeps only its fp32 input (the second norm's output, 4h): no gate/up input casts, no gate, up,
    act or product. Split as `activations.layer_parts_per_token`: the casts each linear keeps go with its part.
    """
    h, q, kv, i, nh = shape.hidden, shape.q, shape.kv, shape.intermediate, shape.heads
    attn = c * (3 * q + 2 * kv) + 4 * nh
    if shape.fused_qkv:
        attn += c * (q + kv)
    qk = (4 * (q + kv) + 4 * (nh + shape.kv_heads) + c * (q + kv)) if shape.qk_norm else 0
    # RMSNorm: fp32 input, rsqrt, and (weight trained) the fp32 normed x; LayerNorm: input, mean, rstd.
    norm_base, normed = (4 * h + 8, 0) if shape.layernorm else (4 * h + 4, 4 * h)
    # Phi-3 fuses gate/up as it fuses q/k/v: one reader of each norm's output.
    attn_readers, mlp_readers = ("qkv_proj",) if shape.fused_qkv else ("q_proj", "k_proj", "v_proj"), \
        ("gate_up_proj",) if shape.fused_qkv else ("gate_proj", "up_proj")
    stash = 4 * h
    if not lora:
        mlp = stash if tiled_mlp else c * h * len(mlp_readers) + 4 * c * i
        return {"norms": 2 * (norm_base + normed), "attention": c * h * len(attn_readers) + attn + qk, "mlp": mlp,
                "adapters": 0}
    # Frozen base: the norms keep no normed copy, frozen linears no input; each adapter keeps its bf16 input
    # and its rank-r intermediate; the MLP keeps gate, up and act for the gradient to earlier layers.
    targets = set(lora_targets)
    fused = {"q_proj", "k_proj", "v_proj"} if shape.fused_qkv else set()
    attn_read = sum(1 for t in attn_readers if t in targets) + (1 if fused & targets else 0)
    mlp_read = 0 if tiled_mlp else sum(1 for t in mlp_readers if t in targets)
    mlp = stash if tiled_mlp else 3 * c * i + (c * i if "down_proj" in targets else 0)
    return {"norms": 2 * norm_base, "attention": c * h * attn_read + attn + qk, "mlp": c * h * mlp_read + mlp,
            "adapters": c * lora_rank * len(lora_targets)}
