"""CUDA kernel path (bf16/fp32) against the float64 reference; runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.parallel import kernels
from tests.cp_reference import HEADS, make_case, reference, rel_err
from tests.distributed import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient", "math"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_block_kernels(kernel, heads, causal):
    dtype = torch.float32 if kernel == "cuda_efficient" else torch.bfloat16
    q, k, v, dout = (t.cuda() for t in make_case(0, 2, HEADS[heads], 256, 128, dtype))
    kern = kernels.KERNELS[kernel]
    out, lse = kern.forward(q, k, v, causal, 128**-0.5)
    grads = kern.backward(dout, q, k, v, out, lse, causal, 128**-0.5)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), causal)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip((out, *grads), ref):
        assert rel_err(got.cpu(), want) <= tol


def _two_ranks_one_device(rank, world_size):
    # Two gloo ranks share one GPU: exercises the CUDA kernels inside the ring (gloo moves CUDA tensors).
    torch.cuda.set_device(0)
    cp = longdoc.ContextParallel(timeout=120)
    errs = []
    for causal in (True, False):
        q, k, v, dout = make_case(1, 1, (8, 2), 512, 128, torch.bfloat16)
        ref = reference(q, k, v, dout, causal)
        ql, kl, vl = (cp.shard(t, dim=2).cuda().requires_grad_() for t in (q, k, v))
        out = longdoc.attention(ql, kl, vl, cp, causal=causal)
        grads = torch.autograd.grad(out, (ql, kl, vl), cp.shard(dout, dim=2).cuda())
        errs.append(max(rel_err(x.cpu(), cp.shard(r, dim=2)) for x, r in zip((out, *grads), ref)))
    return errs


def test_ring_on_cuda_two_ranks_share_device():
    for errs in run_ranks(2, _two_ranks_one_device, deadline=300):
        assert max(errs) <= 2e-2, errs
