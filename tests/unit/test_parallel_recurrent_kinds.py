"""Lightning attention, RG-LRU, RWKV-4 and mLSTM state passing (longdoc.parallel.recurrent) against sequential
float64 definitions, one process: a sequence cut into pieces composed by their summaries (tests.support.recurrent_check)
equals the unsplit scan, outputs, final state and gradients, with decays near 0 and near 1 and a document reset."""

from __future__ import annotations

import pytest
import torch
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru
from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu
from transformers.models.xlstm import modeling_xlstm

from longdoc.parallel.recurrent import lightning, mlstm, rglru, rwkv
from tests.support.recurrent_check import compose

CUTS = (5, 17, 1, 29)  # pieces shorter and longer than the block / chunk sizes, a one-token piece
GEN = torch.Generator


def _check(got, want, rel: float, what: str) -> None:
    got, want = got.double(), want.double()
    err = (got - want).abs().max().item() / want.abs().max().clamp_min(1e-12).item()
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.0e}"


def _grads(outs, leaves, seed=9):
    w = [torch.randn(o.shape, dtype=torch.float64, generator=GEN().manual_seed(seed + i)) for i, o in enumerate(outs)]
    return torch.autograd.grad(sum((o.double() * wi).sum() for o, wi in zip(outs, w)), leaves)


# ---- lightning (MiniMax): constant per-head decay, state KV ----

def _lightning_reference(q, k, v, slope):
    kv = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(q.shape[2]):
        kv = torch.exp(-slope.double()) * kv + k[:, :, t, :, None].double() * v[:, :, t, None, :].double()
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, :, t].double(), kv))
    return torch.stack(outs, 2), kv


@pytest.mark.parametrize("decay", ["near1", "near0"])
def test_lightning_pieces_compose_to_the_sequential_scan(decay):
    g = GEN().manual_seed(0)
    q, k, v = (torch.randn(2, 3, sum(CUTS), 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    slope = (torch.tensor([1e-3, 2e-3, 5e-3]) if decay == "near1" else torch.tensor([5.0, 9.0, 20.0])).double()
    slope = slope[:, None, None].requires_grad_()
    want, want_state = _lightning_reference(q, k, v, slope)
    out, (state,) = compose(lightning.Lightning(slope, block_size=8), (q, k, v), (2, 2, 2), CUTS, out_dim=2)
    _check(out, want, 1e-12, "outputs")
    _check(state, want_state, 1e-12, "final state")
    for name, a, b in zip("q k v slope".split(), _grads([out, state], (q, k, v, slope)),
                          _grads([want, want_state], (q, k, v, slope))):
        _check(a, b, 1e-10, f"grad {name}")


# ---- RG-LRU (RecurrentGemma): diagonal gates, resets ----

def _rglru_reference(x, a, reset):
    h, outs = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float64), []
    for t in range(x.shape[1]):
        h = a[:, t].double() * (~reset[:, t]) * h + x[:, t].double()
        outs.append(h)
    return torch.stack(outs, 1), h


@pytest.mark.parametrize("decay", ["near1", "near0"])
def test_rglru_pieces_compose_to_the_sequential_scan(decay):
    g = GEN().manual_seed(1)
    length = sum(CUTS)
    x = torch.randn(2, length, 6, generator=g).requires_grad_()
    a = (1 - 1e-3 * torch.rand(2, length, 6, generator=g) if decay == "near1"
         else 1e-3 * torch.rand(2, length, 6, generator=g)).requires_grad_()
    reset = torch.zeros(2, length, 1, dtype=torch.bool)
    reset[:, 0] = True
    reset[1, 30] = True  # a position-0 reset inside a piece (HF's reset where position_ids == 0)
    want, want_state = _rglru_reference(x, a, reset)
    scan = RecurrentGemmaRglru._rnn_scan.__get__(object())  # the model's own scan (it uses no module state)
    out, (state,) = compose(rglru.Rglru(scan), (x, a, reset), (1, 1, 1), CUTS)
    _check(out, want, 1e-5, "outputs")
    _check(state, want_state, 1e-5, "final state")
    for name, got, ref in zip("x a".split(), _grads([out, state], (x, a)), _grads([want, want_state], (x, a))):
        _check(got, ref, 1e-4, f"grad {name}")


# ---- RWKV-4: per-channel decay, running numerator / denominator, max-stabilised ----

def _rwkv_reference(time_decay, time_first, key, value):
    """WKV by its definition, float64, O(L^2): y_t = (sum_{j<t} e^{w(t-1-j)+k_j} v_j + e^{u+k_t} v_t) / (same, v=1)."""
    w, u = -torch.exp(time_decay.double()), time_first.double()
    k, v = key.double(), value.double()
    length = k.shape[1]
    t = torch.arange(length)
    age = (t[:, None] - 1 - t[None, :]).double()  # (t, j)
    logw = torch.where((t[None, :] < t[:, None])[None, :, :, None], w * age[None, :, :, None] + k[:, None],
                       torch.tensor(float("-inf"), dtype=torch.float64))  # (batch, t, j, channels)
    diag = (u + k)[:, :, None, :]  # j == t
    logw = torch.where((t[None, :] == t[:, None])[None, :, :, None], diag.expand_as(logw), logw)
    top = logw.max(dim=2, keepdim=True).values
    weight = torch.exp(logw - top)
    return (weight * v[:, None]).sum(2) / weight.sum(2)


@pytest.mark.parametrize("decay", ["near1", "near0"])
def test_rwkv_pieces_compose_to_the_sequential_scan(decay):
    g = GEN().manual_seed(2)
    length, channels = sum(CUTS), 5
    # time_decay is log(-w): w near 0 keeps the state (decay near 1), large w forgets it (near 0)
    time_decay = (torch.full((channels,), -7.0) if decay == "near1" else torch.full((channels,), 3.0))
    time_decay = (time_decay + 0.1 * torch.randn(channels, generator=g)).requires_grad_()
    time_first = torch.randn(channels, generator=g).requires_grad_()
    key = (3 * torch.randn(2, length, channels, generator=g)).requires_grad_()
    value = torch.randn(2, length, channels, generator=g).requires_grad_()
    want = _rwkv_reference(time_decay, time_first, key, value)
    _, want_state = rwkv_linear_attention_cpu(time_decay, time_first, key, value, return_state=True)
    out, state = compose(rwkv.Wkv(rwkv_linear_attention_cpu, time_decay, time_first), (key, value), (1, 1), CUTS)
    _check(out, want, 1e-5, "outputs")
    real = [s * torch.exp(m) for s, m in ((state.num, state.max), (state.den, state.max))]
    want_real = [s * torch.exp(want_state[2]) for s in want_state[:2]]
    for a, b, what in zip(real, want_real, ("num", "den")):
        _check(a, b, 1e-5, f"final {what}")
    leaves = (time_decay, time_first, key, value)
    for name, got, ref in zip("time_decay time_first key value".split(), _grads([out], leaves), _grads([want], leaves)):
        _check(got, ref, 1e-4, f"grad {name}")


# ---- mLSTM (xLSTM): exponential gates, max-stabilised, chunk-aligned pieces ----

def test_mlstm_whole_chunk_pieces_compose_to_the_kernel_exactly():
    """Float64 through the model's own chunkwise kernel: the pieces (whole chunks, as CP gives them when every
    piece is a multiple of the chunk size) composed in the max-plus sense reproduce the unsplit kernel, its
    stabiliser included, to rounding; a document start in the middle resets to the kernel's own start."""
    g = GEN().manual_seed(3)
    chunk, heads, dim = 4, 2, 3
    cuts = (8, 4, 12, 8)
    length = sum(cuts)
    q, k, v = (torch.randn(2, heads, length, dim, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    igate = (4 * torch.randn(2, heads, length, generator=g, dtype=torch.float64)).requires_grad_()
    fgate = (3 + 2 * torch.randn(2, heads, length, generator=g, dtype=torch.float64)).requires_grad_()
    kernel = modeling_xlstm.mlstm_chunkwise_native_autograd
    rec = mlstm.Mlstm(kernel, modeling_xlstm.mlstm_chunkwise_recurrent_fw_C, chunk_size=chunk, eps=1e-6)
    leaves = (q, k, v, igate, fgate)
    want, want_state = kernel(q, k, v, igate, fgate, return_last_states=True, chunk_size=chunk)
    out, state = compose(rec, leaves, (2, 2, 2, 2, 2), cuts, out_dim=2)
    _check(out, want, 1e-12, "outputs")
    for a, b, what in zip(state, want_state, "C n m".split()):
        _check(a, b, 1e-12, f"final {what}")
    for name, got, ref in zip("q k v i f".split(), _grads([out], leaves), _grads([want], leaves)):
        _check(got, ref, 1e-10, f"grad {name}")
    # a document starting at 12: the second part equals the kernel run on it alone
    out, _ = compose(rec, leaves, (2, 2, 2, 2, 2), cuts, starts=(0, 12), out_dim=2)
    alone = kernel(*(x[:, :, 12:] for x in leaves), chunk_size=chunk)
    _check(out[:, :, 12:], alone, 1e-12, "after a reset")


# ---- the driver's own run() (one process, a packed row): a carry (delta rule) and no zero-state output (RWKV) ----

def test_driver_runs_recurrences_with_a_carry_and_without_a_zero_state_output():
    """longdoc.parallel.recurrent.run with a one-rank group over a packed row (its pieces cut at document starts):
    the delta rule's reads travel as local's carry into finish; RWKV's local returns no output, so finish runs
    for every piece, the document starts (state None) included. Each document equals its own unsplit run."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    import longdoc
    from longdoc.hf.recurrent import torch_path
    from longdoc.parallel import layout as layouts
    from longdoc.parallel.recurrent import Segments, delta, run

    cp = longdoc.ContextParallel()
    docs = layouts.Packed((9, 1, 14))
    seg = Segments.of("zigzag", 1, docs.seq_len, docs)
    g = GEN().manual_seed(4)
    q, k = (torch.randn(1, docs.seq_len, 2, 4, generator=g) for _ in range(2))
    v = torch.randn(1, docs.seq_len, 2, 3, generator=g)
    gate, beta = -torch.rand(1, docs.seq_len, 2, generator=g), torch.rand(1, docs.seq_len, 2, generator=g)
    kernel = torch_path(torch_chunk_gated_delta_rule)
    got = run(delta.DeltaRule(kernel, use_qk_l2norm_in_kernel=True), (q, k, v, gate, beta), cp, seg).y
    time_decay, time_first = torch.randn(3, generator=g), torch.randn(3, generator=g)
    key, value = torch.randn(1, docs.seq_len, 3, generator=g), torch.randn(1, docs.seq_len, 3, generator=g)
    got_wkv = run(rwkv.Wkv(rwkv_linear_attention_cpu, time_decay, time_first), (key, value), cp, seg).y
    for start, n in zip(docs.starts(), docs.doc_lens):
        sl = slice(start, start + n)
        want, _ = kernel(q[:, sl], k[:, sl], v[:, sl], gate[:, sl], beta[:, sl], use_qk_l2norm_in_kernel=True)
        _check(got[:, sl], want, 1e-5, f"delta rule, document at {start}")
        want_wkv, _ = rwkv_linear_attention_cpu(time_decay, time_first, key[:, sl], value[:, sl])
        _check(got_wkv[:, sl], want_wkv, 1e-5, f"wkv, document at {start}")
