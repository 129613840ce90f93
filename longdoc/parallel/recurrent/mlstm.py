"""The mLSTM (xLSTM) as a state map with a max-stabilised combine, for state passing.

Per head the real state is a matrix C and a normaliser n, kept with a stabiliser m (real = (C, n) * e^m). The
model's chunkwise kernel updates them once per chunk of `chunk_size` tokens:
    m_{k+1} = max(G_k + m_k, a_k),   C_{k+1} = e^{G_k + m_k - m_{k+1}} C_k + sum_j e^{A_kj - m_{k+1}} k_j v_j^T
(G_k: the chunk's summed log forget gate, A_kj: each token's log weight, a_k = max_j A_kj), starting from
(0, 0, m = 0). m is more than a stabiliser here: the output divides by max(|n q|, e^{-m}) + eps, so it must be
the kernel's own m. m's update is linear in the max-plus sense, so over a piece of whole chunks
    m_out = max(G + m_in, M_p),   C_out = e^{G + m_in - m_out} C_in + e^{M_p - m_out} C_p   (n likewise)
where (C_p, n_p, M_p) is the piece run from (0, 0, m = -inf) and G its summed log forget gate: composing these
gives every piece the kernel's exact entering (C, n, m). That holds when every piece is whole chunks of the
kernel, aligned as in one process (each piece a multiple of `chunk_size` tokens); the caller checks it.

The summary needs only the kernel's state recurrence (`states_fn`, transformers'
mlstm_chunkwise_recurrent_fw_C); a piece's output is the model's chunkwise kernel (`kernel`, transformers'
mlstm_chunkwise_native_autograd) run once from the true entering state.
Torch only: this module knows no model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class Mlstm:
    """The state-passing contract (longdoc.parallel.recurrent.protocol.Recurrence) for one mLSTM layer.

    A piece is (q, k, v, igate, fgate): q, k, v (batch, heads, len, dim), the gate pre-activations (batch, heads,
    len), time at dim 2; the state is (C, n, m) fp32 with m (batch, heads, 1); the summary is (G, C_p, n_p, M_p).
    `local` returns no output: every piece's output is one kernel run from its true state (`finish`).
    """

    def __init__(self, kernel: Callable, states_fn: Callable, chunk_size: int, eps: float):
        self.kernel, self.states_fn, self.chunk_size, self.eps = kernel, states_fn, chunk_size, eps

    def local(self, piece):
        q, k, v, igate, fgate = piece
        bsz, heads, length, dim = q.shape
        n_chunks = length // self.chunk_size
        log_f = F.logsigmoid(fgate.reshape(bsz, heads, n_chunks, self.chunk_size))
        cum = log_f.cumsum(-1)
        empty = torch.full((bsz, heads, 1), float("-inf"), dtype=q.dtype, device=q.device)
        c_states, n_states, m_states = self.states_fn(
            matK=k, matV=v, vecB=cum, vecI=igate.reshape(bsz, heads, n_chunks, self.chunk_size),
            matC_initial=q.new_zeros(bsz, heads, dim, v.shape[-1]), vecN_initial=q.new_zeros(bsz, heads, dim),
            scaMinter_initial=empty, qk_scale=dim ** -0.5, chunk_size=self.chunk_size, num_chunks=n_chunks)
        own = (c_states[:, :, -dim:, :], n_states[:, :, -dim:], m_states[:, :, -1:])
        return None, (log_f.sum((-1, -2))[..., None], *own)

    def advance(self, state, summary):
        log_f, c_p, n_p, m_p = summary
        c_in, n_in, m_in = state if state is not None else (0.0, 0.0, torch.zeros_like(m_p))  # the kernel's start
        decayed = log_f + m_in
        m_out = torch.maximum(decayed, m_p)
        a, b = torch.exp(decayed - m_out), torch.exp(m_p - m_out)
        return a[..., None] * c_in + b[..., None] * c_p, a * n_in + b * n_p, m_out

    def finish(self, piece, y0, state):
        q, k, v, igate, fgate = piece
        c, n, m = (None, None, None) if state is None else state
        return self.kernel(query=q, key=k, value=v, igate=igate, fgate=fgate, c_initial=c, n_initial=n,
                           m_initial=m, return_last_states=False, eps=self.eps, chunk_size=self.chunk_size)


__all__ = ["Mlstm"]
