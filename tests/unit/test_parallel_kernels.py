import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.parallel import kernels
from tests.support.cp_reference import rel_err


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
    with pytest.raises(ValueError, match="strategy must be one of 'ring', 'allgather', 'ulysses', 'usp'"):
        longdoc.attention(q, q, q, cp, strategy="p2p")


# ---- patterns: band masks and soft-capping in the block kernels ------------------------------------

from longdoc.parallel.masks import band_hidden  # noqa: E402
from tests.support.cp_reference import pattern_reference  # noqa: E402


@pytest.mark.parametrize(("name", "softcap"), [("cpu_flash", None), ("math", None), ("math", 1.5)])
@pytest.mark.parametrize("band", [(-3, 0), (None, 2), (-1, None), (2, 5)])
def test_band_and_softcap_kernels_match_reference(name, band, softcap):
    kern = kernels.KERNELS[name]  # cpu_flash never soft-caps: the selector gives such blocks to math
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 2, 13, 16, generator=g)
    v = torch.randn(2, 2, 13, 16, generator=g)
    dout = torch.randn(2, 4, 9, 16, generator=g)
    hidden = band_hidden(9, 13, band)
    rows = (~hidden).any(1)  # the planner never passes rows that see nothing
    q, dout = q[:, :, rows], dout[:, :, rows]
    hidden = hidden[rows]
    out, lse = kern.forward(q, k, v, False, 0.25, band=band, softcap=softcap)
    grads = kern.backward(dout, q, k, v, out, lse, False, 0.25, band=band, softcap=softcap)
    ref = pattern_reference(q, k, v, dout, ~hidden, softcap=softcap, scale=0.25)
    for got, want in zip((out, *grads), ref):
        assert rel_err(got, want) <= 1e-5


def test_selector_for_patterns():
    cpu = torch.device("cpu")
    assert kernels.select(cpu, torch.float32, band=True).name == "cpu_flash"
    assert kernels.select(cpu, torch.bfloat16, softcap=True).name == "math"
    assert kernels.select(cpu, torch.float32, "cpu_flash", softcap=True).name == "math"  # override yields
    assert kernels.select(torch.device("cuda"), torch.float32, band=True).name == "cuda_efficient"
    assert kernels.select(torch.device("cuda"), torch.float32, softcap=True).name == "math"
    assert kernels.lse_dtype(torch.bfloat16) == torch.float32 and kernels._lse_dtype is kernels.lse_dtype


@pytest.mark.parametrize(("kwargs", "msg"), [
    (dict(window=0), "window must be an int >= 1 or None, got 0"),
    (dict(window=2.5), "window must be an int >= 1 or None"),
    (dict(window=4, causal=False), "window needs causal=True"),
    (dict(chunk_size=-3), "chunk_size must be an int >= 1 or None, got -3"),
    (dict(window=-1), "window must be an int >= 1 or None, got -1"),
    (dict(softcap=0.0), "softcap must be a positive finite number"),
    (dict(softcap=float("inf")), "softcap must be a positive finite number"),
    (dict(sinks=torch.zeros(3)), r"sinks must have shape \(q_heads,\) = \(4,\)"),
    (dict(sinks=torch.zeros(4, 1)), r"got a 2-D tensor"),
    (dict(sinks=[0.0] * 4), "sinks must be a torch.Tensor"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), "sinks must be a float16"),
    (dict(documents=(3, 4)), "documents sum to 7 tokens but the full sequence has 8"),
    (dict(documents=(3, 0, 5)), "documents must be cp.pack"),
])
def test_pattern_validation_errors(kwargs, msg):
    cp = longdoc.ContextParallel()
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=msg):
        longdoc.attention(q, k, k.clone(), cp, **kwargs)


def test_row_that_sees_nothing_gives_zeros_not_nan():
    # a sink with no visible key cannot happen in a real pattern (every token sees itself), but a
    # merged row with no block must stay exactly zero through the sink fold and its gradient
    from longdoc.parallel import blocks

    out = torch.zeros(1, 2, 3, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    sinks = torch.tensor([0.5, -1.0])
    o, l = blocks.fold_sinks(out, lse, sinks)
    assert torch.equal(o, out) and torch.equal(l, sinks.view(1, 2, 1).expand(1, 2, 3))
    assert torch.equal(blocks.sinks_grad(torch.randn(1, 2, 3, 4), o, l, sinks), torch.zeros(2))
