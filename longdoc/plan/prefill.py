"""Per-rank peak memory of a context-parallel prefill (`longdoc ask`: `KVSession.prefill` under no_grad), from a
model's config alone, term by term.

Notation as in longdoc.plan.memory: L the prompt padded to the layout's multiple (2*cp zigzag, cp contiguous),
N = L/cp tokens per rank, h hidden, I MLP width, q = heads*head_dim, kv = kv_heads*head_dim, nh heads, V vocabulary,
P parameters, n_a attention layers; w bytes per element of the dtype the model is loaded in (evaluation keeps
weights and activations in it: no autocast, no gradients).

  weights        P*w                every rank holds the whole model (no FSDP in evaluation)
  KV cache       n_a*2*N*kv*w       each rank keeps the K/V of ITS tokens, every one of them (ShardedCache keeps
                                    windowed layers' too: masks apply the window); recurrent mixers keep a
                                    fixed-size state instead (not priced)
  RoPE cos/sin   2*N*rotary_dim*w   shared by the layers
  layer forward  3*N*h*w (the embeddings, which the model's forward holds, the residual and the normed input)
                 + the larger of
                   MLP         3*w*N*I: act, up and their product (gate is freed once act exists)
                   attention   N*(3q*w + 12q) + 8*N*nh: q and a copy, one block's output, and in fp32 the output
                               accumulator, its merged copy and one merge temporary (longdoc.parallel.blocks.merge),
                               the lse's; + the strategy's K/V: ring stacks the local K/V
                               into one message and receives the next into a spare, 2*(2*N*kv*w) (one stack at
                               cp=1); other strategies: their backward buffers (longdoc.plan.strategies.buffers),
                               an upper bound for a forward without gradients
  logits         V*(w + 4)          the last prompt position only (logits_to_keep), and its fp32 copy
  runtime        the process itself (hardware.Device.runtime_gib: Python + torch, or the CUDA context + NCCL)
"""

from __future__ import annotations

from longdoc.parallel.layout import num_chunks, round_up
from longdoc.plan import strategies
from longdoc.plan.hardware import DEVICES, GIB
from longdoc.plan.setups import Term
from longdoc.plan.shapes import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def rank_tokens(tokens: int, cp: int, layout: str = "zigzag") -> int:
    """N: the prompt's tokens on one rank, padding included (KVSession.prefill pads to the layout's multiple)."""
    return round_up(tokens, num_chunks(layout, cp)) // cp


def prefill_terms(shape: ModelShape, tokens: int, cp: int, *, dtype: str = "float32", strategy: str = "ring",
                  ulysses: int | None = None, layout: str = "zigzag", gpu: bool = False) -> list[Term]:
    """The terms live on one rank at the prefill's peak, the last layer's forward (module docstring).

    Args:
        shape: the model (longdoc.plan.shapes.model_shape).
        tokens: the prompt's length, before padding.
        cp: ranks sharing the prompt.
        dtype: the dtype the model is loaded and run in ("float32", "bfloat16", "float16").
        strategy, ulysses, layout: the CP attention, as `--strategy`, `--ulysses-size` and `--layout` name them.
        gpu: the rank runs on a CUDA device (its runtime is the CUDA context), else on a CPU.
    Returns:
        weights, KV cache, cos/sin, the layer's forward, logits and runtime, in bytes.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    w, n, sh = DTYPE_BYTES[dtype], rank_tokens(tokens, cp, layout), shape
    h, i, q, kv, nh, layers = sh.hidden, sh.intermediate, sh.q, sh.kv, sh.heads, sh.attention_layers
    mlp = 3 * w * n * i
    if strategy == "ring" or cp == 1:  # every strategy is the same local attention at cp=1
        stacks = 2 if cp > 1 else 1
        comm, comm_formula = stacks * 2 * n * kv * w, f"{stacks}*(2*N*kv*w) = {stacks}*(2*{n:,}*{kv}*{w})"
    else:
        comm, comm_formula = strategies.buffers(strategy, cp=cp, ulysses=ulysses, tokens=n, q_heads=nh,
                                                kv_heads=sh.kv_heads, head_dim=sh.head_dim, c=w)
    attention = n * (3 * q * w + 12 * q) + 8 * n * nh + comm
    if mlp >= attention:
        part, formula = mlp, f"3*w*N*I = 3*{n:,}*{h}*{w} + 3*{w}*{n:,}*{i:,}"
    else:  # comm_formula: the strategy's buffers, with the numbers put in
        part, formula = attention, (f"N*(3q*w + 12q) + 8*N*nh + buffers = 3*{n:,}*{h}*{w} + {n:,}*(3*{q}*{w} + "
                                    f"12*{q}) + 8*{n:,}*{nh} + [{comm_formula}]")
    runtime = DEVICES["h100" if gpu else "cpu"].runtime_gib
    return [
        Term("weights", "weights", f"P*w = {sh.params.total:,}*{w}", sh.params.total * w),
        Term(f"KV cache ({layers} attention layers)", "activations",
             f"n_a*2*N*kv*w = {layers}*2*{n:,}*{kv}*{w}", layers * 2 * n * kv * w),
        Term("rotary cos/sin", "activations", f"2*N*rotary_dim*w = 2*{n:,}*{sh.rotary_dim}*{w}",
             2 * n * sh.rotary_dim * w),
        Term(f"layer forward ({'MLP' if part == mlp else 'attention'})", "activations",
             f"3*N*h*w + {formula}", 3 * n * h * w + part),
        Term("logits (last position)", "loss", f"V*(w + 4) = {sh.vocab:,}*({w} + 4)", sh.vocab * (w + 4)),
        Term("runtime", "runtime", f"{'CUDA context + NCCL' if gpu else 'Python + torch'}: {runtime} GiB",
             runtime * GIB),
    ]


def prefill_bytes(shape: ModelShape, tokens: int, cp: int, **kwargs) -> float:
    """Bytes one rank needs at the prefill's peak: the sum of `prefill_terms` (same arguments)."""
    return sum(t.bytes for t in prefill_terms(shape, tokens, cp, **kwargs))
