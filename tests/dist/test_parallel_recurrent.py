"""longdoc.parallel.recurrent over real gloo ranks (2, 3, 4) against one-process float64 references: outputs,
final states and the gradients of every input and parameter (A, D, dt_bias: each rank's share, summed over the
group), for SSD (Mamba2), the selective scan (Mamba1), a dense toy
recurrence (re-run finish) and conv halos; plain and packed rows (rows packed alike and differently), both
layouts, decays near 0 and near 1, pieces shorter than the conv kernel."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import longdoc
from longdoc.parallel import layout as layouts
from longdoc.parallel.recurrent import SSD, Segments, Selective, halo, run, tail
from tests.support import recurrent_reference as ref
from tests.support.distributed import run_ranks


def _rows(docs_per_row, length):
    return [layouts.Packed(d) if d is not None else None for d in docs_per_row]


def _check(cp, name, make, rec, dims, out_dim, length, docs_per_row, reference, params) -> dict[str, float]:
    """Errors of run() (outputs, final state of row docs, input and parameter grads) against the full-row reference.
    params: name -> (the tensor `rec` holds, the reference's copy), both leaves."""
    inputs = [t.requires_grad_() for t in make()]
    segs = [Segments.of(cp.layout, cp.size, length, d) for d in _rows(docs_per_row, length)]
    shard = [torch.cat([layouts.shard_runs(x.narrow(0, b, 1), d, s.runs[cp.rank]) for b, s in enumerate(segs)])
             for x, d in zip(inputs, dims)]
    local = [x.detach().clone().requires_grad_() for x in shard]
    first_end = min(d.doc_lens[0] if d is not None else length for d in _rows(docs_per_row, length))
    out = run(rec, local, cp, segs if len(set(segs)) > 1 else segs[0], dims=dims, out_dim=out_dim,
              final_at=first_end if len(set(segs)) == 1 else None)
    want, want_final = reference(inputs, docs_per_row, first_end)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=want.dtype)
    (want * weight).sum().backward()
    w_local = torch.cat([layouts.shard_runs(weight.narrow(0, b, 1), out_dim, s.runs[cp.rank])
                         for b, s in enumerate(segs)])
    (out.y * w_local).sum().backward()
    y_want = torch.cat([layouts.shard_runs(want.narrow(0, b, 1), out_dim, s.runs[cp.rank]) for b, s in enumerate(segs)])
    errs = {"y": (out.y - y_want).abs().max().item()}
    if out.final is not None:
        errs["final"] = (out.final[0] - want_final).abs().max().item()
    for i, (x, d, lx) in enumerate(zip(inputs, dims, local)):
        g = torch.cat([layouts.shard_runs(x.grad.narrow(0, b, 1), d, s.runs[cp.rank]) for b, s in enumerate(segs)])
        errs[f"grad{i}"] = (lx.grad - g).abs().max().item()
    for pname, (mine, theirs) in params.items():  # every rank's share of a parameter's gradient, summed
        g = mine.grad.clone()
        dist.all_reduce(g, group=cp.group)
        errs[f"grad_{pname}"] = (g - theirs.grad).abs().max().item() / theirs.grad.abs().max().item()
    return errs


def _leaves(**tensors) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the CP run's leaf, the reference's leaf): two copies, so each side gets its own gradient."""
    return {k: (t.clone().requires_grad_(), t.clone().requires_grad_()) for k, t in tensors.items()}


def _per_doc(fn, inputs, dims, out_dim, docs_per_row, length, first_end):
    rows, final = [], None
    for b, d in enumerate(docs_per_row):
        lens = d or (length,)
        parts = []
        for s, n in zip(layouts.Packed(lens).starts(), lens):
            y, h = fn(*[x.narrow(0, b, 1).narrow(dd, s, n) for x, dd in zip(inputs, dims)])
            parts.append(y)
            if s == 0 and n == first_end:
                final = h if final is None else torch.cat([final, h])
        rows.append(torch.cat(parts, dim=out_dim))
    return torch.cat(rows), final


def _cases(cp, world):
    length = 12 * world
    odd = (length - 7, 1, 2, 4)  # pieces of 1 and 2 tokens: shorter than the kernel
    for docs in ([None, None], [(5, length - 5)] * 2, [odd, (length // 2, length - length // 2)]):
        rows = f"{cp.layout}/{'packed' if docs[0] else 'plain'}{'-mixed' if docs[0] != docs[1] else ''}"
        for decay in ("near0", "near1"):
            tag = f"{rows}/{decay}"
            g = torch.Generator().manual_seed(world)  # the same parameters on every rank
            D = torch.rand(4, generator=g, dtype=torch.float64)
            bias = torch.rand(4, generator=g, dtype=torch.float64) - 0.5
            x, dt, A, B, C = ref.ssd_inputs(2, length, 4, 3, 1, 5, seed=world, decay=decay)
            p = _leaves(A=A, D=D, dt_bias=bias)
            rec = SSD(ref.ssd_scan, p["A"][0], 4, D=p["D"][0], dt_bias=p["dt_bias"][0], dt_softplus=True)
            yield ("ssd/" + tag, lambda t=(x, dt, B, C): [v.clone() for v in t], rec, (1, 1, 1, 1), 1, length, docs,
                   lambda ins, dd, fe, A=p["A"][1], D=p["D"][1], bias=p["dt_bias"][1]: _per_doc(
                       lambda xs, dts, Bs, Cs: ref.ssd_sequential(xs, dts, A, Bs, Cs, D, bias, True), ins,
                       (1, 1, 1, 1), 1,
                       dd, length, fe), p)
            x, dt, A, B, C, _ = ref.selective_inputs(2, length, 6, 4, seed=world, decay=decay)
            D6 = torch.rand(6, generator=g, dtype=torch.float64)
            p = _leaves(A=A, D=D6, dt_bias=bias.repeat(2)[:6])
            rec = Selective(ref.selective_scan, p["A"][0], D=p["D"][0], delta_bias=p["dt_bias"][0],
                            delta_softplus=True)
            yield ("selective/" + tag, lambda t=(x, dt, B, C): [v.clone() for v in t], rec, (2, 2, 2, 2), 2, length,
                   docs, lambda ins, dd, fe, A=p["A"][1], D6=p["D"][1], bias=p["dt_bias"][1]: _per_doc(
                       lambda xs, dts, Bs, Cs: ref.selective_sequential(xs, dts, A, Bs, Cs, D6, None, bias, True),
                       ins, (2, 2, 2, 2), 2, dd, length, fe), p)
        M, u, c = ref.dense_inputs(2, length, 3, seed=world)
        toy = ref.DenseToy()
        yield (f"dense/{rows}", lambda t=(M, u, c): [v.clone() for v in t],
               toy, (1, 1, 1), 1, length, docs,
               lambda ins, dd, fe, toy=toy: _per_doc(lambda Ms, us, cs: toy.scan(Ms, us, cs)[:2], ins, (1, 1, 1), 1,
                                                     dd, length, fe), {})


def _halo_case(cp, length, docs, kernel) -> dict[str, float]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, length, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, kernel, generator=g, dtype=torch.float64)
    packed = layouts.Packed(docs) if docs else None
    seg = Segments.of(cp.layout, cp.size, length, packed)
    lens = docs or (length,)
    want = torch.cat([ref.causal_conv(p, w) for p in x.split(list(lens), dim=-1)], dim=-1)
    weight = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (want * weight).sum().backward()
    local = layouts.shard_runs(x.detach(), 2, seg.runs[cp.rank]).requires_grad_()
    ext, keep = halo(local, kernel - 1, cp, seg, dim=-1)
    y = ref.causal_conv(ext, w).index_select(-1, keep)
    (y * layouts.shard_runs(weight, 2, seg.runs[cp.rank])).sum().backward()
    end = lens[0]
    t = tail(local.detach(), kernel, cp, seg, at=end)
    t_want = torch.nn.functional.pad(x.detach()[..., :end], (kernel, 0))[..., -kernel:]
    return {"y": (y - layouts.shard_runs(want, 2, seg.runs[cp.rank])).abs().max().item(),
            "grad": (local.grad - layouts.shard_runs(x.grad, 2, seg.runs[cp.rank])).abs().max().item(),
            "tail": (t - t_want).abs().max().item()}


def _all(rank, world):
    out = {}
    for lay in ("zigzag", "contiguous"):
        cp = longdoc.ContextParallel(layout=lay, timeout=60)
        for name, make, rec, dims, out_dim, length, docs, reference, params in _cases(cp, world):
            out[name] = _check(cp, name, make, rec, dims, out_dim, length, docs, reference, params)
        for docs in (None, (12 * world - 7, 1, 2, 4)):
            for kernel in (2, 4, 6):
                out[f"halo/{lay}/{'packed' if docs else 'plain'}/k{kernel}"] = _halo_case(cp, 12 * world, docs, kernel)
    return out


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_state_passing_and_halos_match_one_process(world):
    per_rank = run_ranks(world, _all, deadline=600)
    bad = {(r, name): errs for r, res in enumerate(per_rank) for name, errs in res.items()
           if max(errs.values()) > 1e-9}
    assert not bad, bad
    assert len(per_rank[0]) == 2 * (3 * 5 + 6)


def _saved_bytes(rank, world) -> int:
    """Bytes this rank saves for backward in one state-passing run (each storage once, inputs and parameters
    excluded): SSD with a large state (4 heads x 16 x 64) and 8 tokens per rank in two zigzag pieces."""
    cp = longdoc.ContextParallel(layout="zigzag", timeout=60)
    length = 8 * world
    x, dt, A, B, C = ref.ssd_inputs(1, length, 4, 16, 1, 64, seed=0, decay="near1")
    rec = SSD(ref.ssd_scan, A.requires_grad_(), 4)
    seg = Segments.of(cp.layout, cp.size, length, None)
    local = [layouts.shard_runs(v, 1, seg.runs[cp.rank]).requires_grad_() for v in (x, dt, B, C)]
    skip = {t.untyped_storage().data_ptr() for t in (*local, A)}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(rec, local, cp, seg)
    out.y.sum().backward()  # the backward's collectives run on every rank
    return sum(seen.values())


def test_saved_summaries_do_not_grow_with_cp():
    """Per rank, state passing keeps only its own pieces' summaries for backward (the backward gathers them
    again): with the same tokens per rank, a rank saves the same bytes at cp=3 as at cp=2. Keeping every rank's
    gathered summaries and the composed states (autograd through the all-gather) saved more at cp=3."""
    two, three = max(run_ranks(2, _saved_bytes)), max(run_ranks(3, _saved_bytes))
    assert two > 0 and three == two, (two, three)
