"""MiniMax lightning attention layers (MiniMax-Text-01 / M1) under CP.

The layer's block loop lives inside its forward, so the kind computes that forward around the CP scan: the
module's own projections (qkv_proj and its activation, output_gate, out_proj), padding mask and RMSNorm over all
heads, with the block loop replaced by longdoc.parallel.recurrent.lightning (the same blocks within each piece,
the entering KV state from state passing). Packed rows reset the state at document starts. Decoding is refused by
name: MiniMax keeps its linear state in its own MiniMaxCache, which the KV session does not carry.
"""

from __future__ import annotations

import sys

import torch

from longdoc.hf import recurrent
from longdoc.hf.kinds.registry import Forward, register
from longdoc.parallel.recurrent import run
from longdoc.parallel.recurrent.lightning import Lightning


def forward(module, handle, original, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
            **kwargs):
    call = recurrent.Call.of(module, handle, kwargs)
    bsz, seq_len, _ = hidden_states.shape
    heads, dim = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    qkv = sys.modules[type(module).__module__].apply_mask_to_padding_states(qkv, attention_mask)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv.reshape(bsz, seq_len, heads, 3 * dim), dim, dim=3))
    out = run(Lightning(module.slope_rate, module.block_size), (q, k, v), call.cp, call.segments(bsz, seq_len),
              dims=2, out_dim=2).y
    out = module.norm(out.transpose(1, 2).reshape(bsz, seq_len, heads * dim))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None  # (no attention weights: CP attention returns none either)


KIND = register(Forward(
    name="lightning",
    matches=lambda m: type(m).__name__ == "MiniMaxLightningAttention",
    forward=forward,
    layer_types=frozenset({"linear_attention"}),
    replaces_attention=True,
    packed=True,
))
