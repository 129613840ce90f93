"""RecurrentGemma (Griffin) recurrent blocks under CP: a causal conv1d, then the RG-LRU.

The kind runs the block's own forward with two attributes of its submodules shadowed for that call: the
`conv_1d` module's forward (its own convolution on every piece preceded by its halo, longdoc.hf.recurrent.Call)
and the RG-LRU's `_rnn_scan` method (the model's scan on every piece from a zero state, composed by state
passing: longdoc.parallel.recurrent.rglru). Every gate is the model's own; its reset at position 0 is the
document start of a packed row, where the conv halo is zeros too. The block runs with use_cache=False: it keeps
its cache on itself (conv1d_state, rg_lru.recurrent_states), which a CP forward must neither read nor leave
holding one rank's state. Decoding is refused by name: the KV session does not carry that module-held state.
"""

from __future__ import annotations

import torch

from longdoc.hf import recurrent
from longdoc.hf.kinds.primitives import shadowed
from longdoc.hf.kinds.registry import Forward, register
from longdoc.parallel.recurrent import run
from longdoc.parallel.recurrent.rglru import Rglru


def forward(module, handle, original, input_states, position_ids, attention_mask=None, use_cache=True, **kwargs):
    call = recurrent.Call.of(module, handle, kwargs)
    segs = call.segments(input_states.shape[0], input_states.shape[1])
    conv, lru = module.conv_1d, module.rg_lru
    conv_forward, scan = conv.forward, lru._rnn_scan

    def cp_conv(x):  # nn.Conv1d with padding kernel - 1: its first len(x) outputs are the causal conv
        return call.conv(lambda e, _w: conv_forward(e)[..., :e.shape[-1]], x, conv.weight[:, 0])

    def cp_scan(hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32):
        if recurrent_states is not None:
            raise RuntimeError("longdoc: an RG-LRU scan with a state ran on CP-sharded tokens")
        out = run(Rglru(scan), (hidden_states, recurrent_gate, reset), call.cp, segs, dims=1, out_dim=1)
        return out.y.to(hidden_states.dtype), None

    with shadowed(conv, forward=cp_conv), shadowed(lru, _rnn_scan=cp_scan):
        return original(input_states, position_ids, attention_mask, False, **kwargs)


KIND = register(Forward(
    name="rglru",
    matches=lambda m: type(m).__name__ == "RecurrentGemmaRecurrentBlock",
    forward=forward,
    layer_types=frozenset({"linear_attention"}),  # config.layer_types names the recurrent blocks so
    replaces_attention=True,
    packed=True,
))
