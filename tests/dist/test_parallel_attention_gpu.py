"""CUDA kernel path (bf16/fp32) against the float64 reference; runs only where a GPU is present."""

from __future__ import annotations

import pytest
import torch

import longdoc
from longdoc.parallel import kernels
from tests.support.cp_reference import HEADS, make_case, reference, rel_err
from tests.support.distributed import run_ranks

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


def _two_ranks_one_device(rank, world_size, strategy="ring"):
    # Two gloo ranks share one GPU: exercises the CUDA kernels inside the ring (gloo moves CUDA tensors), and
    # the all-to-all of the Ulysses strategies on CUDA tensors.
    torch.cuda.set_device(0)
    cp = longdoc.ContextParallel(timeout=120, ulysses_size=world_size if strategy == "usp" else None)
    errs = []
    for causal in (True, False):
        q, k, v, dout = make_case(1, 1, (8, 2), 512, 128, torch.bfloat16)
        ref = reference(q, k, v, dout, causal)
        ql, kl, vl = (cp.shard(t, dim=2).cuda().requires_grad_() for t in (q, k, v))
        out = longdoc.attention(ql, kl, vl, cp, causal=causal, strategy=strategy)
        grads = torch.autograd.grad(out, (ql, kl, vl), cp.shard(dout, dim=2).cuda())
        errs.append(max(rel_err(x.cpu(), cp.shard(r, dim=2)) for x, r in zip((out, *grads), ref)))
    return errs


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "usp"])
def test_cp_on_cuda_two_ranks_share_device(strategy):
    for errs in run_ranks(2, _two_ranks_one_device, strategy, deadline=300):
        assert max(errs) <= 2e-2, errs


# ---- attention patterns on CUDA: band masks (memory-efficient kernel), soft-capping, sinks --------

from longdoc.parallel.masks import band_hidden  # noqa: E402
from tests.support.cp_reference import PATTERNS, pattern_reference, run_pattern_case  # noqa: E402

_GPU_KERNEL_CASES = [("cuda_efficient", torch.float32, None), ("cuda_efficient", torch.bfloat16, None),
                     ("math", torch.bfloat16, 2.0), ("math", torch.float32, 2.0)]
if kernels.flash_attn_available():
    _GPU_KERNEL_CASES.append(("flash_attn", torch.bfloat16, 2.0))


@pytest.mark.parametrize(("kernel", "dtype", "softcap"), _GPU_KERNEL_CASES)
@pytest.mark.parametrize("band", [None, (-40, 0), (3, None)])
def test_cuda_pattern_kernels(kernel, dtype, softcap, band):
    kern = kernels.KERNELS[kernel]
    if band is not None and not kern.band:
        pytest.skip("the selector never gives band blocks to this kernel")
    q, k, v, dout = (t.cuda() for t in make_case(3, 2, (8, 2), 192, 128, dtype))
    rows = torch.ones(192, dtype=torch.bool) if band is None else (~band_hidden(192, 192, band)).any(1)
    q, dout = q[:, :, rows.cuda()], dout[:, :, rows.cuda()]
    extra = {"band": band, "softcap": softcap} if band is not None or softcap is not None else {}
    out, lse = kern.forward(q, k, v, False, 128**-0.5, **extra)
    grads = kern.backward(dout, q, k, v, out, lse, False, 128**-0.5, **extra)
    visible = torch.ones(int(rows.sum()), 192, dtype=torch.bool) if band is None else ~band_hidden(192, 192, band)[rows]
    ref = pattern_reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), visible, softcap=softcap, scale=128**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip((out, *grads), ref):
        assert rel_err(got.cpu(), want) <= tol


def test_every_pattern_on_cuda_one_rank():
    cp_factory = lambda layout: longdoc.ContextParallel(layout=layout)  # noqa: E731
    failures = []
    for i, name in enumerate(PATTERNS):
        for dtype in ("fp32", "bf16"):
            for strategy in ("ring", "ulysses"):
                errs = run_pattern_case(cp_factory, (name, "zigzag", strategy, "gqa", dtype), 50 + i, 1,
                                        device="cuda")
                tol = 1e-4 if dtype == "fp32" else 2e-2
                if not all(e <= tol for e in errs.values()):
                    failures.append((name, dtype, strategy, errs))
    assert not failures, failures
