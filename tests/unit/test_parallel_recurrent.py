"""longdoc.parallel.recurrent in one process: pieces, and each recurrence's state passing played for every
rank of a group (the all-gather done by hand) against a sequential float64 scan, decays near 0 and near 1."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mamba.modeling_mamba import mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

from longdoc.hf.recurrent import torch_path
from longdoc.parallel import layout as layouts
from longdoc.parallel.recurrent import SSD, Segments, Selective
from longdoc.parallel.recurrent import state as driver
from tests.support import recurrent_reference as ref


def _segment_cases():
    for world in (1, 2, 3, 4):
        for lay in ("zigzag", "contiguous"):
            yield world, lay, 8 * world, None
            yield world, lay, 12 * world, layouts.Packed((5 * world, 1, 3, 12 * world - 5 * world - 4))


@pytest.mark.parametrize("world, lay, seq_len, docs", list(_segment_cases()))
def test_pieces_cover_every_position_once_and_never_cross_a_document_start(world, lay, seq_len, docs):
    seg = Segments.of(lay, world, seq_len, docs)
    seen = []
    for r in range(world):
        local = layouts.runs(lay, r, world, seq_len, docs)
        offset = 0
        for p in seg.pieces(r):
            assert p.offset == offset and p.length > 0
            offset += p.length
            assert seg.doc_of(p.start) == p.doc == seg.doc_of(p.end - 1)
            seen += range(p.start, p.end)
        assert offset == sum(n for _, n in local)
    assert sorted(seen) == list(range(seq_len))


def _play(rec, inputs, dims, out_dim, seg: Segments, final_at=None):
    """run() for every rank of seg in one process (the all-gather by hand): the full output in global order."""
    world = seg.world_size
    everyone = seg.all_pieces()
    n_max = max(len(ps) for ps in everyone)
    shards = [[layouts.shard_runs(x, d, seg.runs[r]) for x, d in zip(inputs, dims)] for r in range(world)]
    locals_ = [[rec.local(driver._piece(shards[r], dims, p)) for p in everyone[r]] for r in range(world)]
    per_tensor = []
    for k in range(len(locals_[0][0][1])):
        rows = []
        for r in range(world):
            t = torch.stack([s[k] for _, s in locals_[r]])
            rows.append(torch.cat([t, t.new_zeros((n_max - t.shape[0], *t.shape[1:]))]))
        per_tensor.append(torch.stack(rows))
    located, final = [], None
    for r in range(world):
        entering, final = driver._compose(rec, everyone, per_tensor, r, final_at)
        for p, (y0, _), s in zip(everyone[r], locals_[r], entering):
            y = y0 if s is None else rec.finish(driver._piece(shards[r], dims, p), y0, s)
            located.append((p.start, y))
    return torch.cat([y for _, y in sorted(located, key=lambda sy: sy[0])], dim=out_dim), final


def _per_doc(fn, inputs, dims, out_dim, doc_lens):
    parts = [fn(*[x.narrow(d, s, n) for x, d in zip(inputs, dims)])
             for s, n in zip(layouts.Packed(doc_lens).starts(), doc_lens)]
    return torch.cat([y for y, _ in parts], dim=out_dim), [h for _, h in parts]


CASES = [(world, lay, decay, packed) for world in (2, 3, 4) for lay in ("zigzag", "contiguous")
         for decay in ("near0", "near1", "mixed") for packed in (False, True)]


def _docs(length, packed):
    return (length // 2 + 3, 1, length - length // 2 - 4) if packed else (length,)


@pytest.mark.parametrize("world, lay, decay, packed", CASES)
def test_ssd_state_passing_equals_a_sequential_scan(world, lay, decay, packed):
    length = 10 * world
    x, dt, A, B, C = ref.ssd_inputs(2, length, heads=4, head_dim=3, groups=1, state=5, seed=world, decay=decay)
    D, bias = torch.rand(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) - 0.5
    rec = SSD(ref.ssd_scan, A, chunk_size=4, D=D, dt_bias=bias, dt_softplus=True, dt_limit=(0.0, 50.0))
    docs = _docs(length, packed)
    seg = Segments.of(lay, world, length, layouts.Packed(docs) if packed else None)
    y, final = _play(rec, (x, dt, B, C), (1, 1, 1, 1), 1, seg, final_at=docs[0])
    want, states = _per_doc(lambda *a: ref.ssd_sequential(*a[:1], a[1], A, *a[2:], D=D, dt_bias=bias, softplus=True,
                                                          dt_limit=(0.0, 50.0)), (x, dt, B, C), (1, 1, 1, 1), 1, docs)
    assert (y - want).abs().max().item() < 1e-10
    assert (final[0] - states[0]).abs().max().item() < 1e-10


@pytest.mark.parametrize("world, lay, decay, packed", CASES)
def test_selective_state_passing_equals_a_sequential_scan(world, lay, decay, packed):
    length = 10 * world
    x, dt, A, B, C, _ = ref.selective_inputs(2, length, channels=6, state=4, seed=world, decay=decay)
    D, bias = torch.rand(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64) - 0.5
    rec = Selective(ref.selective_scan, A, D=D, delta_bias=bias, delta_softplus=True)
    docs = _docs(length, packed)
    seg = Segments.of(lay, world, length, layouts.Packed(docs) if packed else None)
    y, final = _play(rec, (x, dt, B, C), (2, 2, 2, 2), 2, seg, final_at=docs[0])
    want, states = _per_doc(lambda x, dt, B, C: ref.selective_sequential(x, dt, A, B, C, D=D, delta_bias=bias,
                                                                         delta_softplus=True),
                            (x, dt, B, C), (2, 2, 2, 2), 2, docs)
    assert (y - want).abs().max().item() < 1e-10
    assert (final[0] - states[0]).abs().max().item() < 1e-10


def test_transformers_torch_scans_have_the_semantics_the_closed_forms_assume():
    """HF's pure-torch SSD / selective scans (fp32) against the float64 sequential references."""
    x, dt, A, B, C = ref.ssd_inputs(2, 23, heads=4, head_dim=3, groups=2, state=5)
    D, bias = torch.rand(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) - 0.5
    y, h = torch_path(mamba2_chunk_scan)(*(t.float() for t in (x, dt, A, B, C)), 8, D=D.float(),
                                          dt_bias=bias.float(), dt_softplus=True, dt_limit=(0.0, 3.0),
                                          return_final_states=True)
    want, wh = ref.ssd_sequential(x, dt, A, B, C, D, bias, True, (0.0, 3.0))
    assert (y.double() - want).abs().max().item() < 1e-4 and (h.double() - wh).abs().max().item() < 1e-4
    x, dt, A, B, C, z = ref.selective_inputs(2, 17, channels=6, state=4)
    bias = torch.rand(6, dtype=torch.float64)
    y, h = torch_path(mamba_selective_scan)(*(t.float() for t in (x, dt, A, B, C)), D=D[:1].repeat(6).float(),
                                            z=z.float(), delta_bias=bias.float(), delta_softplus=True,
                                            return_last_state=True)
    want, wh = ref.selective_sequential(x, dt, A, B, C, D[:1].repeat(6), z, bias, True)
    assert (y.double() - want).abs().max().item() < 1e-4 and (h.double() - wh).abs().max().item() < 1e-4


def test_final_at_must_be_a_document_end():
    x, dt, A, B, C = ref.ssd_inputs(1, 8, heads=2, head_dim=2, groups=1, state=2)
    rec = SSD(ref.ssd_scan, A, chunk_size=4)
    with pytest.raises(ValueError, match="final_at=3 is not the end of a piece"):
        _play(rec, (x, dt, B, C), (1, 1, 1, 1), 1, Segments.of("zigzag", 2, 8), final_at=3)


@pytest.mark.parametrize("world, decay, skip, seed", [(w, d, s, seed) for w in (2, 4) for d in ("near1", "mixed")
                                                       for s in ("none", "fp32") for seed in (0, 2)])
def test_selective_bf16_state_passing_is_within_one_process_bf16_error(world, decay, skip, seed):
    """Mamba1 in bf16 through transformers' own torch scan: CP (rounded once to the scan's output dtype, as
    hf/kinds/mamba.py does) is no further from float64 than one process's bf16 run: its largest error within 1.5x,
    its RMS error no larger (a correction added to an already rounded output, as before, was 1.01-1.13x one
    process's RMS on every case). skip: the D skip connection, none (the scan's output is bf16) or fp32 (as the
    models pass module.D.float(): an fp32 output)."""
    scan = torch_path(mamba_selective_scan)
    length = 32 * world
    x, dt, A, B, C, _ = ref.selective_inputs(2, length, channels=16, state=8, seed=seed, decay=decay)
    g = torch.Generator().manual_seed(seed)
    D = torch.rand(16, generator=g, dtype=torch.float64).float() if skip == "fp32" else None
    bias = (torch.rand(16, generator=g, dtype=torch.float64) - 0.5).float()
    xb, dtb, Bb, Cb = (t.bfloat16() for t in (x, dt, B, C))
    want, _ = ref.selective_sequential(xb.double(), dtb.double(), A.float().double(), Bb.double(), Cb.double(),
                                       D=None if D is None else D.double(), delta_bias=bias.double(),
                                       delta_softplus=True)
    one = scan(xb, dtb, A.float(), Bb, Cb, D=D, delta_bias=bias, delta_softplus=True)
    rec = Selective(scan, A.float(), D=D, delta_bias=bias, delta_softplus=True)
    y, _ = _play(rec, (xb, dtb, Bb, Cb), (2, 2, 2, 2), 2, Segments.of("zigzag", world, length))
    y = y.to(rec.out_dtype(xb))
    assert y.dtype == one.dtype
    worst = lambda a: ((a.double() - want).abs().max() / want.abs().max()).item()  # noqa: E731
    rms = lambda a: ((a.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()  # noqa: E731
    assert worst(y) <= 1.5 * worst(one), (worst(y), worst(one))
    assert rms(y) <= rms(one), (rms(y), rms(one))
