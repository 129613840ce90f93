"""xLSTM (mLSTM) layers under CP: the kind replaces the layer's `xLSTMBackend`, which is exactly the scan.

Every piece runs the model's own chunkwise kernel (mlstm_chunkwise_native_autograd) from its true entering
(C, n, m) state, from state passing with the kernel's own max-plus stabiliser (longdoc.parallel.recurrent.mlstm);
the output divides by max(|n q|, e^-m) + eps, so m must be the kernel's, and it is when every piece is whole
chunks of `chunk_size` tokens, aligned as in one process. Other lengths, and packed rows (whose per-document
pieces do not fall on chunks), are refused by name before any communication. xLSTM has no layer_types: the kind
matches the backend class explicitly. The external `xlstm` package's kernels replace these classes; such a model
has no xLSTMBackend and stays refused as an unknown mixer.
"""

from __future__ import annotations

import sys

from longdoc.hf import recurrent
from longdoc.hf.kinds.primitives import fresh
from longdoc.hf.kinds.registry import Forward, register
from longdoc.parallel.batch import CPInputError
from longdoc.parallel.recurrent import run
from longdoc.parallel.recurrent.mlstm import Mlstm


def forward(module, handle, original, query, key, value, igate, fgate, c_initial=None, n_initial=None,
            m_initial=None, return_last_states=None, mode=None):
    config = module.config
    call = recurrent.Call.of(module, handle, {})
    cp = call.cp
    if not fresh(c_initial, n_initial, m_initial):
        raise RuntimeError("longdoc: an xLSTM layer under CP got a state to continue from (a filled xLSTMCache); "
                           "run it without CP")
    seq_len = query.shape[2]
    segs = call.segments(query.shape[0], seq_len)
    chunk = int(config.chunk_size)
    rows = [segs] if not isinstance(segs, list) else segs
    bad = sorted({p.length for s in rows for ps in s.all_pieces() for p in ps if p.length % chunk})
    if bad:
        multiple = chunk * cp.multiple
        raise CPInputError(
            f"longdoc.patch: xLSTM under CP needs every rank's pieces to be whole chunks of chunk_size={chunk} "
            f"tokens (its kernel's stabiliser is per chunk), got pieces of {bad} tokens; pad the batch to a "
            f"multiple of {multiple} tokens ({chunk} x {cp.multiple} chunks of the {cp.layout} layout), unpacked")
    ns = sys.modules[type(module).__module__]
    rec = Mlstm(module.chunkwise_kernel_fn, ns.mlstm_chunkwise_recurrent_fw_C, chunk, float(config.eps))
    res = run(rec, (query, key, value, igate, fgate), cp, segs, dims=2, out_dim=2, final_at=seq_len * cp.size)
    mode = mode or config.mode
    if "train" in mode and not (config.return_last_states if return_last_states is None else return_last_states):
        return res.y
    return res.y, res.final


KIND = register(Forward(
    name="xlstm",
    matches=lambda m: type(m).__name__ == "xLSTMBackend",
    forward=forward,
    replaces_attention=True,  # xLSTM has no attention layers and no config.layer_types
    packed=False,
))
