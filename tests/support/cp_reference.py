"""Single-process float64 reference for context-parallel attention tests."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# head layouts the Ulysses tests add: SmolLM2's 9 query / 3 K/V heads (uneven over 2 and 4 ranks)
ALL_HEADS = {**HEADS, "smol": (9, 3)}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: relative to the tensor's scale, robust to entries near zero."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_case(seed: int, batch: int, heads: tuple[int, int], seq_len: int, head_dim: int, dtype: torch.dtype):
    """Full q, k, v, dout in `dtype` (identical on every rank for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(batch, hq, seq_len, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, hkv, seq_len, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, hkv, seq_len, head_dim, generator=g).to(dtype)
    dout = torch.randn(batch, hq, seq_len, head_dim, generator=g).to(dtype)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool):
    """Output and (dq, dk, dv) of full-sequence SDPA in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), dq, dk, dv


def _repeat_kv(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    # transformers' repeat_kv (expand + reshape): its backward sums a group's gradients in fp32 and rounds once
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, q_heads // h, n, d).reshape(b, q_heads, n, d)


def one_device(q, k, v, dout, mask: torch.Tensor | None = None, causal: bool = True, softcap: float | None = None,
               sinks: torch.Tensor | None = None):
    """Output and gradients (dq, dk, dv[, dsinks]) of the same attention computed by ONE process in q's dtype, as
    transformers does it on CPU: K/V repeated to the query heads (its SDPA gets GQA natively only on CUDA/XPU), then
    SDPA (with the bool mask, True = visible) where no soft-capping or sinks are asked, else the eager recipe: scores
    in the dtype, soft-capped, masked, softmax in fp32 (a sink as one more logit), rounded to the dtype, times V."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    hq = q.shape[1]
    ql, kl, vl = leaves[0], _repeat_kv(leaves[1], hq), _repeat_kv(leaves[2], hq)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask, is_causal=causal and mask is None)
    else:
        s = ql @ kl.transpose(-1, -2) * q.shape[-1] ** -0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.float()
        if mask is None:
            mask = pattern_mask(q.shape[2], causal)
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, leaves[3].float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        p = torch.softmax(s, dim=-1)
        p = (p[..., :-1] if sinks is not None else p).to(q.dtype)
        out = p @ vl
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), *grads)


# One device's error is the bound: CP in bf16 may be at most 1.5x as far from float64 as one process computing the
# same attention in bf16, in relative RMS error (rms_err). RMS, not the largest entry: one entry's extra rounding swings
# a max-entry ratio by 2x on these small tensors, while the RMS measures the error level. Where the float64 gradient
# is exactly zero (a window of 1: every softmax has one term) both errors are cancellation noise (~1e-8) and have no
# scale of their own: they are held to one bf16 rounding of an O(1) value, ZERO_REF_FLOOR, absolute.
# dsinks is not held to it: a few sums over every row that cancel, so its error is the final bf16 rounding of a few
# numbers and two recipes of equal accuracy differ by up to 2.5x from seed to seed (measured in one process); it
# stays under check_cases' bound.
ONE_DEVICE_RATIO, ZERO_REF_FLOOR = 1.5, 2.0**-9


def rms_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| (absolute RMS where ref is exactly zero)."""
    d, r = a.double() - ref.double(), ref.double()
    if not r.abs().max() > 0:
        return (d.norm() / max(d.numel(), 1) ** 0.5).item()
    return (d.norm() / r.norm()).item()


def vs_one(names, got, base, ref) -> dict[str, tuple[float, float, bool]]:
    """{tensor: (CP's rms_err, one device's rms_err, is the reference zero)}, each on the same shard."""
    return {n: (rms_err(g, r), rms_err(b, r), not r.abs().max() > 0) for n, g, b, r in zip(names, got, base, ref)
            if n != "dsinks"}


def check_vs_one_device(results) -> None:
    """Assert every (case, errors, vs_one(...)) is within ONE_DEVICE_RATIO x one device's error (ZERO_REF_FLOOR where
    the reference is zero); `errors` are check_cases' and are not read here."""
    failures = []
    for case, _, errs in results:
        bad = {k: f"{e:.2e} vs one device {one:.2e} ({e / max(one, 1e-30):.2f}x)" for k, (e, one, zero) in errs.items()
               if not e <= (ZERO_REF_FLOOR if zero else ONE_DEVICE_RATIO * one)}  # `not <=` also catches NaN
        if bad:
            failures.append(f"{case}: {bad}")
    assert not failures, f"{len(failures)} cases over {ONE_DEVICE_RATIO}x one device's error:\n" + "\n".join(failures)


def cases(head_dims=(64, 128), strategies=("ring", "allgather")):
    return list(itertools.product(("zigzag", "contiguous"), (True, False), tuple(HEADS), head_dims,
                                  tuple(DTYPES), strategies))


def run_case(cp, case, seed: int, chunk: int = 6, batch: int = 2, head_counts: tuple[int, int] | None = None,
             one: bool = False):
    """Relative errors of CP attention vs the float64 reference for one case, on this rank.
    head_counts: (q_heads, kv_heads) instead of case[2]'s.
    one: return (errors, vs_one(...): CP's and one device's errors on the same shard)."""
    import longdoc

    layout, causal, heads, head_dim, dtype_name, strategy = case
    seq_len = chunk * cp.multiple
    q, k, v, dout = make_case(seed, batch, head_counts or ALL_HEADS[heads], seq_len, head_dim, DTYPES[dtype_name])
    ref = reference(q, k, v, dout, causal)
    ql, kl, vl = (cp.shard(t, dim=2).requires_grad_() for t in (q, k, v))
    out = longdoc.attention(ql, kl, vl, cp, causal=causal, strategy=strategy)
    grads = torch.autograd.grad(out, (ql, kl, vl), cp.shard(dout, dim=2))
    names = ("out", "dq", "dk", "dv")
    errs = {n: rel_err(x, cp.shard(r, dim=2)) for n, x, r in zip(names, (out, *grads), ref)}
    if not one:
        return errs
    base = one_device(q, k, v, dout, causal=causal)
    return errs, vs_one(names, (out, *grads), [cp.shard(x, dim=2) for x in base], [cp.shard(r, dim=2) for r in ref])


# ---- attention patterns: windows, chunks, soft-capping, sinks, documents -------------------------

def pattern_mask(seq_len: int, causal: bool = True, window: int | None = None, chunk_size: int | None = None,
                 doc_lens: tuple[int, ...] | None = None) -> torch.Tensor:
    """Bool (seq_len, seq_len), True where query i sees key j: written from the definitions, not
    from longdoc's planner, so the two can disagree."""
    i = torch.arange(seq_len).unsqueeze(1)
    j = torch.arange(seq_len).unsqueeze(0)
    vis = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= j > i - window
    if doc_lens is not None:
        doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
        vis &= doc.unsqueeze(1) == doc.unsqueeze(0)
    if chunk_size is not None:
        # chunks count from each document's start (a packed row means every document on its own)
        start = torch.tensor([0, *doc_lens]).cumsum(0)[:-1].repeat_interleave(torch.tensor(doc_lens)) \
            if doc_lens is not None else torch.zeros(seq_len, dtype=torch.long)
        pos = torch.arange(seq_len) - start
        vis &= (pos.unsqueeze(1) // chunk_size) == (pos.unsqueeze(0) // chunk_size)
    return vis


def branch_mask(seq_len: int, spans) -> torch.Tensor:
    """Bool (seq_len, seq_len), True where query i sees key j under sibling branches, from the definition: i and j
    in one pair (or one stretch of tokens outside every pair), j <= i, and not (i in rejected and j in chosen)."""
    doc = torch.zeros(seq_len, dtype=torch.long)
    part = torch.zeros(seq_len, dtype=torch.long)  # 0 prompt or outside the pairs, 1 chosen, 2 rejected
    for p, c, r, e in spans:
        doc[p:] += 1
        doc[e:] += 1
        part[c:r], part[r:e] = 1, 2
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    vis = (j <= i) & (doc.unsqueeze(1) == doc.unsqueeze(0))
    return vis & ~((part.unsqueeze(1) == 2) & (part.unsqueeze(0) == 1))


def pattern_reference(q, k, v, dout, mask: torch.Tensor, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, scale: float | None = None):
    """Output and gradients (dq, dk, dv[, dsinks]) of masked, soft-capped, sink attention in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().double().requires_grad_())
    q64, k64, v64 = leaves[:3]
    groups = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(groups, 1), v64.repeat_interleave(groups, 1)
    s = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = leaves[3].view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    out = p @ v64
    grads = torch.autograd.grad(out, leaves, dout.double())
    return (out.detach(), *grads)


def _docs_for(seq_len: int) -> tuple[int, ...]:
    """Documents for one row: single-token ones, odd ones, and one long enough to cross every chunk boundary."""
    head = [1, 3, 1, 2]
    long_doc = seq_len - sum(head) - 4
    return (1, long_doc, *head[1:], 1, 3) if long_doc > 0 else (seq_len,)


# name -> pattern kwargs, given the full length n; `docs` marks a packed row
PATTERNS: dict[str, dict] = {
    "window3": {"window": 3},                 # shorter than one chunk
    "window1": {"window": 1},
    "window11": {"window": 11},               # crosses chunks and ranks
    "window_long": {"window": 10_000},        # longer than the sequence
    "chunk5": {"chunk_size": 5},              # crosses chunk boundaries at odd places
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": True},
    "docs": {"docs": True},
    "docs_bidir": {"docs": True, "causal": False},
    "window_docs": {"window": 4, "docs": True},
    "sinks_window": {"sinks": True, "window": 5},
    "softcap_window": {"softcap": 1.5, "window": 6},
    "chunk_docs_sinks": {"chunk_size": 4, "docs": True, "sinks": True},
    "everything": {"window": 3, "softcap": 3.0, "sinks": True, "docs": True},
    # selected keys (sparse indexed attention): random global positions per query, with unused slots, repeats
    # and future keys (which causality still hides)
    "selected": {"selected": 6},
    "selected_docs_sinks": {"selected": 5, "docs": True, "sinks": True},
    "selected_softcap": {"selected": 9, "softcap": 2.5},
    "selected_window": {"selected": 6, "window": 5},  # band blocks with a lower edge
}


def random_selection(batch: int, seq_len: int, n: int, seed: int) -> torch.Tensor:
    """(batch, seq_len, n) global key positions per query: random keys anywhere (future ones included), about a
    fifth unused (-1), and the query itself in one slot so every query sees at least one key."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, seq_len, (batch, seq_len, n), generator=g)
    sel = sel.masked_fill(torch.rand(batch, seq_len, n, generator=g) < 0.2, -1)
    slot = torch.randint(0, n, (batch, seq_len, 1), generator=g)
    return sel.scatter(2, slot, torch.arange(seq_len).view(1, -1, 1).expand(batch, -1, 1))


def selection_mask(selected: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where key j is in selected[b, i] (from the definition)."""
    j = torch.arange(seq_len).view(1, 1, 1, -1)
    return (selected.unsqueeze(-1) == j).any(dim=2).unsqueeze(1)


def pattern_cases(full: bool = False, strategies=("ring", "allgather")) -> list[tuple]:
    """(pattern, layout, strategy, heads, dtype) cases: the default set cycles heads and uses bf16 on
    every other pattern; `full` is the whole product (slow)."""
    out = []
    for p_i, name in enumerate(PATTERNS):
        for l_i, (layout, strategy) in enumerate(itertools.product(("zigzag", "contiguous"), strategies)):
            if "selected" in PATTERNS[name] and strategy in ("ulysses", "usp"):
                continue  # refused by name (tests/unit/test_parallel_ulysses_plan.py)
            if full:
                out += [(name, layout, strategy, h, d) for h in HEADS for d in DTYPES]
                continue
            heads = tuple(HEADS)[(p_i + l_i) % len(HEADS)]
            out.append((name, layout, strategy, heads, "fp32"))
            if (p_i + l_i) % 2 == 0:
                out.append((name, layout, strategy, heads, "bf16"))
    return out


def one_process(q, k, v, dout, sinks: torch.Tensor, causal: bool, spec: dict, documents) -> tuple[torch.Tensor, ...]:
    """Output and gradients (dq, dk, dv, dsinks) of longdoc's attention with `spec`'s pattern over the FULL tensors in
    one process (a ring of one rank, with the kernels longdoc.attention picks): no CP."""
    from longdoc.parallel import kernels
    from longdoc.parallel.layout import Packed
    from longdoc.parallel.masks import Pattern
    from longdoc.parallel.ring import ring_attention

    docs = Packed(documents.doc_lens) if documents is not None else None
    pattern = Pattern(causal, spec.get("window"), spec.get("chunk_size"), spec.get("softcap"), docs)
    pattern = pattern.normalized(q.shape[2])
    capped = pattern.softcap is not None
    kernel = kernels.select(q.device, q.dtype, softcap=capped)
    band = kernels.select(q.device, q.dtype, band=True, softcap=capped)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out = ring_attention(*leaves[:3], None, "zigzag", causal, kernels.default_scale(q.shape[-1]), kernel,
                         pattern=pattern, sinks=leaves[3], band_kernel=band)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    # A gradient that is exactly zero (a window of 1: each softmax has one term) has no scale of its
    # own: compare it absolutely, so fp32 rounding noise of 1e-7 is not "1e23 times too large".
    if ref.double().abs().max() < 1e-12:
        return (got.double() - ref.double()).abs().max().item()
    return rel_err(got, ref)


def run_pattern_case(cp_factory, case, seed: int, world_size: int, batch: int = 2, head_dim: int = 16,
                     device: str = "cpu", doc_lens: tuple[int, ...] | None = None, one: bool = False):
    """Relative errors of CP attention with a pattern vs the float64 reference, on this rank.
    doc_lens: the packed row's documents instead of the default ones (`docs` patterns only).
    one: return (errors, vs_one(...): CP's and one device's errors on the same shard) (not with selected keys)."""
    import longdoc

    name, layout, strategy, heads, dtype_name = case
    spec = dict(PATTERNS[name])
    cp = cp_factory(layout)
    docs = spec.pop("docs", False)
    with_sinks = spec.pop("sinks", False)
    causal = spec.pop("causal", True)
    # odd chunk lengths; a packed row only needs a multiple of the world size (7 per rank: odd)
    seq_len = (sum(doc_lens) if doc_lens else 7 * world_size) if docs else 5 * cp.multiple
    dtype = DTYPES[dtype_name]
    q, k, v, dout = make_case(seed, batch, ALL_HEADS[heads], seq_len, head_dim, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(ALL_HEADS[heads][0], generator=g).to(dtype) if with_sinks else None
    packed = cp.pack(doc_lens or _docs_for(seq_len)) if docs else None
    mask = pattern_mask(seq_len, causal, spec.get("window"), spec.get("chunk_size"),
                        packed.doc_lens if packed else None)
    n_selected = spec.pop("selected", None)
    selected = None
    if n_selected is not None:
        selected = random_selection(batch, seq_len, n_selected, seed + 2)
        mask = mask & selection_mask(selected, seq_len)
        selected = cp.shard(selected, dim=1, documents=packed).to(device)
    ref = pattern_reference(q, k, v, dout, mask, spec.get("softcap"), sinks)
    shard = lambda t: cp.shard(t, dim=2, documents=packed)  # noqa: E731
    leaves = [shard(t).to(device).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.clone().to(device).requires_grad_())
    out = longdoc.attention(*leaves[:3], cp, causal=causal, strategy=strategy, sinks=leaves[3] if with_sinks else None,
                            documents=packed, selected=selected, **spec)
    grads = [g_.cpu() for g_ in torch.autograd.grad(out, leaves, shard(dout).to(device))]
    out = out.cpu()
    errs = {"out": _err(out, shard(ref[0]))}
    for n_, g_, r_ in zip(("dq", "dk", "dv"), grads[:3], ref[1:4]):
        errs[n_] = _err(g_, shard(r_))
    if sinks is not None:
        # sinks are a parameter shared by the group: each rank gets its share, and the shares summed
        # over the group (as the gradient all-reduce does for every parameter) are the full gradient
        dsinks = grads[3].double()
        if cp.size > 1:
            torch.distributed.all_reduce(dsinks, group=cp.group)
        errs["dsinks"] = _err(dsinks, ref[4])
    if not one:
        return errs
    base = one_device(q, k, v, dout, mask, causal, spec.get("softcap"), sinks)
    if sinks is not None:
        # with sinks one device runs transformers' eager recipe (fp32 probabilities) or longdoc's kernels + sink fold
        # in one process, whose kernel reads the rounded output (delta = dout . out): up to 1.8x eager's dq/dk error
        # on tiny segments (chunk_docs_sinks) with no CP at all. The baseline is the less accurate of the two.
        alone = one_process(q, k, v, dout, sinks, causal, spec, packed)
        base = tuple(max(b_, a_, key=lambda t: rms_err(t, r_)) for b_, a_, r_ in zip(base, alone, ref))
    shard_all = lambda ts: [shard(t) for t in ts[:4]]  # noqa: E731
    return errs, vs_one(("out", "dq", "dk", "dv"), (out, *grads[:3]), shard_all(base), shard_all(ref))


TOL = {"fp32": 1e-5, "bf16": 1e-2}  # relative; bf16 scales with the world size (more merge steps)


def check_cases(results, world_size: int) -> None:
    """Assert every (case, errors) result is within its dtype's tolerance; "exact" cases must be 0."""
    failures = []
    for case, errs in results:
        if case[4] == "exact":
            assert all(e == 0.0 for e in errs.values()), (case, errs)
            continue
        tol = TOL[case[4]] * (world_size if case[4] == "bf16" else 1)
        bad = {k: e for k, e in errs.items() if not e <= tol}  # `not <=` also catches NaN
        if bad:
            failures.append(f"{case}: {bad} > {tol}")
    assert not failures, f"{len(failures)} cases over tolerance:\n" + "\n".join(failures)
