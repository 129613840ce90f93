"""Delta-rule state passing (longdoc.parallel.recurrent.delta) against a sequential float64 scan, one process:
a piece entered with a given state, and a sequence split into pieces composed by their summaries (outputs,
final state and gradients), for Gated DeltaNet (scalar decay) and KDA (per-channel decay), decays near 0 and 1."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from longdoc.hf.recurrent import torch_path
from longdoc.parallel.recurrent import delta
from tests.support.recurrent_check import compose

KERNELS = {"gdn": torch_path(qwen3_next.torch_chunk_gated_delta_rule),
           "kda": torch_path(kimi.chunk_kimi_delta_attention)}
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 6


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _sequential(kind, q, k, v, g, beta, state):
    """The delta rule one token at a time in float64 (the definition), l2-normalised q and k."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    rep = V_HEADS // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    q, k = _l2(q) * K_DIM ** -0.5, _l2(k)
    s = state.double() if state is not None else torch.zeros(q.shape[0], V_HEADS, K_DIM, V_DIM, dtype=torch.float64)
    outs = []
    for t in range(q.shape[1]):
        decay = g[:, t].exp()[..., None, None] if kind == "gdn" else g[:, t].exp()[..., None]
        s = s * decay
        delta_v = (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta_v[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outs, 1), s


def _inputs(kind, length, decay, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, K_HEADS if kind == "gdn" else V_HEADS, K_DIM, generator=gen)
    k = torch.randn(2, length, K_HEADS if kind == "gdn" else V_HEADS, K_DIM, generator=gen)
    v = torch.randn(2, length, V_HEADS, V_DIM, generator=gen)
    shape = (2, length, V_HEADS) if kind == "gdn" else (2, length, V_HEADS, K_DIM)
    # log decays: near 0 means the state is kept (decay near 1), very negative means it is forgotten (near 0)
    g = -(torch.rand(shape, generator=gen) * 1e-3 if decay == "near1" else 8 + 8 * torch.rand(shape, generator=gen))
    beta = torch.rand(2, length, V_HEADS, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta)]


def _kernel_kwargs():
    return {"use_qk_l2norm_in_kernel": True}


@pytest.mark.parametrize("decay", ["near1", "near0", "mixed"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_piece_entered_with_a_state_is_the_sequential_scan(kind, decay):
    q, k, v, g, beta = _inputs(kind, 37, "near1" if decay == "mixed" else decay)
    if decay == "mixed":
        g = g.detach().clone()
        g[:, 10:20] = -12.0
        g.requires_grad_()
    state = torch.randn(2, V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(3))
    want_out, want_state = _sequential(kind, q, k, v, g, beta, state)
    out, final = delta.scan(KERNELS[kind], q, k, v, g, beta, state, **_kernel_kwargs())
    assert (out.double() - want_out).abs().max() <= 2e-5 * want_out.abs().max()
    assert (final.double() - want_state).abs().max() <= 2e-5 * want_state.abs().max()


@pytest.mark.parametrize(("decay", "cuts"), [("near1", (64, 1, 30)), ("near0", (5, 70, 23))])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_pieces_composed_by_their_summaries_are_the_unsplit_scan(kind, decay, cuts):
    length = sum(cuts)
    q, k, v, g, beta = _inputs(kind, length, decay, seed=1)
    want_out, want_state = _sequential(kind, q, k, v, g, beta, None)
    loss_w = torch.randn(want_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want_grads = torch.autograd.grad((want_out * loss_w).sum() + want_state.sum(), (q, k, v, g, beta))
    # every piece runs from the augmented state on its own (as on different ranks), then composes in order
    rec = delta.DeltaRule(KERNELS[kind], **_kernel_kwargs())
    out, (state,) = compose(rec, (q, k, v, g, beta), (1,) * 5, cuts)
    assert (out.double() - want_out).abs().max() <= 2e-5 * want_out.abs().max()
    assert (state.double() - want_state).abs().max() <= 2e-5 * want_state.abs().max()
    grads = torch.autograd.grad((out.double() * loss_w).sum() + state.double().sum(), (q, k, v, g, beta))
    # The kernel computes in fp32: near-zero decays put its g gradient ~1e-3 off float64 (cumulative log decays
    # of -1000 keep 4 digits). Composition must add no error of its own to the unsplit run of the same kernel.
    whole_out, whole_state = delta.scan(KERNELS[kind], q, k, v, g, beta, None, **_kernel_kwargs())
    whole_grads = torch.autograd.grad((whole_out.double() * loss_w).sum() + whole_state.double().sum(),
                                      (q, k, v, g, beta))
    for name, got, whole, want in zip("q k v g beta".split(), grads, whole_grads, want_grads):
        scale = want.abs().max().clamp_min(1e-6)
        assert (got.double() - want).abs().max() <= 1e-4 * scale + 2 * (whole.double() - want).abs().max(), name
