import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.parallel import kernels
from tests.cp_reference import rel_err


@pytest.mark.parametrize("name", ["cpu_flash", "math"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_block_kernel_forward_backward_match_sdpa(name, heads, causal, dtype):
    k_ = kernels.KERNELS[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads[0], 12, 16, generator=g).to(dtype)
    k = torch.randn(2, heads[1], 12, 16, generator=g).to(dtype)
    v = torch.randn(2, heads[1], 12, 16, generator=g).to(dtype)
    dout = torch.randn(2, heads[0], 12, 16, generator=g).to(dtype)
    scale = 0.3
    out, lse = k_.forward(q, k, v, causal, scale)
    dq, dk, dv = k_.backward(dout, q, k, v, out, lse, causal, scale)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale, enable_gqa=True)
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA grads come back compact
    for got, want in zip((out, dq, dk, dv), (ref, *grads)):
        assert rel_err(got, want) <= tol


def test_math_kernel_row_without_keys_is_zero_not_nan():
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 0, 4, dtype=torch.float64)
    out, lse = kernels.KERNELS["math"].forward(q, k, k, False, 0.5)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_selector():
    assert kernels.select(torch.device("cpu"), torch.bfloat16).name == "cpu_flash"
    assert kernels.select(torch.device("cuda"), torch.float32).name == "cuda_efficient"
    assert kernels.select(torch.device("cuda"), torch.float64).name == "math"
    assert kernels.select(torch.device("cpu"), torch.float32, "math").name == "math"
    with pytest.raises(ValueError, match="kernel must be one of"):
        longdoc.ContextParallel(kernel="triton")


@pytest.mark.parametrize(("q", "k", "msg"), [
    ((1, 4, 8, 16), (1, 3, 8, 16), r"q_heads \(4\) must be a multiple of kv_heads \(3\)"),
    ((1, 4, 8, 16), (1, 2, 6, 16), "same local tokens"),
    ((1, 4, 8, 16), (1, 2, 8, 32), "share batch size and head_dim"),
    ((4, 8, 16), (1, 2, 8, 16), "must be 4-D"),
])
def test_validation_errors(q, k, msg):
    cp = longdoc.ContextParallel()
    with pytest.raises(ValueError, match=msg):
        longdoc.attention(torch.randn(q), torch.randn(k), torch.randn(k), cp)


def test_validation_dtype_and_strategy():
    cp = longdoc.ContextParallel()
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="one dtype"):
        longdoc.attention(q, q.double(), q, cp)
    with pytest.raises(ValueError, match="float16, bfloat16, float32 or float64"):
        longdoc.attention(q.int(), q.int(), q.int(), cp)
    with pytest.raises(ValueError, match="strategy must be one of 'ring', 'allgather'"):
        longdoc.attention(q, q, q, cp, strategy="ulysses")
