"""Sparse indexed attention (DSA) families patched under CP (gloo, 2 and 3 ranks) against one process: logits,
loss, every gradient, and the indexer's top-k itself, query by query; packed and unpacked (with left padding and
the padding to cp.multiple); both strategies and layouts; CP greedy decoding against one process's.

The references are the definitions: every row (left padding dropped) or every packed document run on its own by
the unpatched twin with eager attention. The tiny models have two index heads, so many keys score exactly 0 and
ties at the k-th place are common (counted, and required to occur): CP's top-k must break them as one process's
torch.topk does. Queries with fewer than TOPK earlier keys see all of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.support.distributed import run_ranks
from tests.support.hf_cases import pieces_reference
from tests.support.hf_dsa import ACCEPTANCE, TESTED, TOPK, dsa_pair
from tests.support.hf_families import check_model_errors
from tests.support.small_tiles import small_tiles

LENGTH, LEAD = 46, 5  # padded to 48 at cp 2 and 3; row 1 of the unpacked batch is left-padded by LEAD tokens
DOCS = (13, 1, 9, 21)  # the packed row: a one-token document, and documents longer than TOPK


def _indexers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Indexer")]


class _Record:
    """Forward hooks on every indexer: their outputs (top-k indices), in call order."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(lambda m, a, k, o: self.out.append(o.detach().clone()),
                                                with_kwargs=True) for m in _indexers(model)]

    def close(self):
        for h in self.handles:
            h.remove()


class _Ties(TorchFunctionMode):
    """Counts the one-process indexer rows whose k-th and (k+1)-th scores are equal (a tie top-k must break)."""

    def __init__(self):
        super().__init__()
        self.tied = self.rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.topk, torch.topk) and args[0].dim() == 3 and args[0].shape[-1] > TOPK:
            v = args[0].detach().sort(dim=-1, descending=True).values
            real = torch.isfinite(v[..., TOPK])
            self.rows += int(real.sum())
            self.tied += int(((v[..., TOPK - 1] == v[..., TOPK]) & real).sum())
        return func(*args, **kwargs)


def _reference(ref, pieces):
    """Every piece run on its own: (logits, mean loss, grads, per piece the indexer outputs, ties)."""
    chosen, ties = [], _Ties()

    def forward(ids, pos):
        rec = _Record(ref)
        with ties:
            out = ref(input_ids=ids[None], position_ids=pos[None]).logits[0]
        rec.close()
        chosen.append(rec.out)
        return out

    return (*pieces_reference(ref, pieces, forward), chosen, ties)


def _selection_mismatches(chosen, full, where) -> tuple[int, int]:
    """(queries whose visible selected keys differ, queries with fewer than TOPK earlier keys). chosen[p][l]: one
    process's indices of piece p at indexer call l (1, n, k); full[l]: CP's (batch, seq, width), gathered;
    where[p] = (row, offset, n): the piece's place in the CP batch."""
    bad = short = 0
    for p, (row, off, n) in enumerate(where):
        for layer, want in enumerate(chosen[p]):
            got = full[layer][row, off:off + n].long() - off
            for q in range(n):
                a = {int(j) for j in want[0, q] if 0 <= int(j) <= q}
                b = {int(j) for j in got[q] if 0 <= int(j) <= q}
                bad += a != b
                short += q + 1 < TOPK
    return bad, short


def _grads_err(model, cp, ref_grads) -> float:
    """The largest error of a gradient tensor relative to its own largest element, or to 1e-2 of the model's largest
    gradient where a tensor's own is below that: such tiny gradients (HY-V4's hyper-connection head: 2e-4 to 3e-6
    beside gradients of 0.2-0.4) are sums that cancel, whose fp32 rounding follows the larger terms (errors of 4e-8,
    1.5e-4 of their own size, with the production tiles and with small ones alike). A wrong tiny gradient still
    shows: all wrong, 2e-4 against a floor of 4e-3 is 5e-2."""
    pairs = []
    for n, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=cp.group)
        pairs.append((g, ref_grads.get(n, torch.zeros_like(p))))
    floor = max(1e-6, 1e-2 * max(want.abs().max().item() for _, want in pairs))
    return max(((g - want).abs().max() / want.abs().max().clamp_min(floor)).item() for g, want in pairs)


def _cp_step(model, cp, batch, documents=None):
    model.zero_grad()
    rec = _Record(model)
    out = model(**cp.shard_batch(batch))
    rec.close()
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    full = [cp.gather(o.contiguous(), dim=1, documents=documents) for o in rec.out]
    return out, loss, full


def _unpacked(ref, model, cp, seed: int):
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :LEAD] = 0
    pieces = [(ids[0], torch.arange(LENGTH)), (ids[1, LEAD:], torch.arange(LEAD, LENGTH))]
    logits, ref_loss, grads, chosen, ties = _reference(ref, pieces)
    out, loss, full = _cp_step(model, cp, {"input_ids": ids, "labels": ids, "attention_mask": mask})
    padded = -(-LENGTH // cp.multiple) * cp.multiple
    want = torch.zeros(2, padded, logits[0].shape[-1])
    real = torch.zeros(2, padded, dtype=torch.bool)
    for r, lg in enumerate(logits):  # cp.shard_batch rolls a left-padded row: its real tokens come first
        want[r, :lg.shape[0]], real[r, :lg.shape[0]] = lg, True
    logit_err = (out.logits.detach() - cp.shard(want, dim=1))[cp.shard(real, dim=1)].abs().max().item()
    bad, short = _selection_mismatches(chosen, full, [(0, 0, LENGTH), (1, 0, LENGTH - LEAD)])
    return (logit_err, abs(loss.item() - ref_loss.item()), _grads_err(model, cp, grads)), (bad, ties.tied, short)


def _packed(ref, model, cp, seed: int):
    from transformers import DataCollatorWithFlattening

    from longdoc.parallel.layout import Packed

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in DOCS]
    logits, ref_loss, grads, chosen, ties = _reference(ref, [(d, torch.arange(d.numel())) for d in docs])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
    batch = {k: v for k, v in batch.items() if not k.startswith("max_length")}
    packed = Packed(DOCS).pad_to(cp.multiple)
    out, loss, full = _cp_step(model, cp, batch, documents=packed)
    want = torch.zeros(1, packed.seq_len, logits[0].shape[-1])
    want[0, :sum(DOCS)] = torch.cat(logits)
    real = torch.zeros(1, packed.seq_len, dtype=torch.bool)
    real[0, :sum(DOCS)] = True
    shard = lambda t: cp.shard(t, dim=1, documents=packed)  # noqa: E731
    logit_err = (out.logits.detach() - shard(want))[shard(real)].abs().max().item()
    starts = [0, *torch.tensor(DOCS).cumsum(0)[:-1].tolist()]
    bad, short = _selection_mismatches(chosen, full, [(0, s, n) for s, n in zip(starts, DOCS)])
    return (logit_err, abs(loss.item() - ref_loss.item()), _grads_err(model, cp, grads)), (bad, ties.tied, short)


def _rank_dsa(rank: int, world_size: int, archs: tuple[str, ...], allgather: tuple[str, ...] = ()) -> tuple:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    errors, selection = [], []
    cases = [(arch, "unpacked+left-pad", _unpacked, cp, "ring") for arch in archs]
    cases += [(arch, "packed", _packed, cp, "ring") for arch in archs]
    contiguous = longdoc.ContextParallel(layout="contiguous", timeout=60)
    cases += [(arch, f"allgather+contiguous {name}", fn, contiguous, "allgather")
              for arch in allgather for name, fn in (("unpacked", _unpacked), ("packed", _packed))]
    if allgather:  # activation checkpointing: the recompute in backward runs the indexer (and its gathers) again
        cases.append((allgather[0], "packed+checkpointing", _packed, cp, "ring"))
    with small_tiles() as tiles:  # query tiles of 1-3 rows, selected-key tiles of 2-5: every tiling branch runs
        for i, (arch, case, fn, group, strategy) in enumerate(cases):
            ref, model = dsa_pair(arch)
            if "checkpointing" in case:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                model.train()
            longdoc.patch(model, group, strategy=strategy)
            errs, sel = fn(ref, model, group, seed=10 + i)
            errors.append((arch, case, *errs))
            selection.append((arch, case, *sel))
    return errors, selection, dict(tiles)


def _check(per_rank) -> None:
    check_model_errors([errors for errors, _, _ in per_rank])
    for _, selection, tiles in per_rank:
        assert tiles.get("dsa", 0) > 0 and tiles.get("causal", 0) > 0, f"the small tiles did not run: {tiles}"
        bad = [f"{a} {c}: {n} queries" for a, c, n, _, _ in selection if n]
        assert not bad, "CP's top-k differs from one process's:\n" + "\n".join(bad)
        assert sum(t for _, _, _, t, _ in selection) > 0, "no tie at the k-th place was tested"
        assert sum(s for _, _, _, _, s in selection) > 0, "no query with fewer than TOPK earlier keys was tested"


def test_dsa_families_cp2():
    _check(run_ranks(2, _rank_dsa, TESTED, ("glm_moe_dsa",), deadline=900, pg_timeout=60))


def test_dsa_acceptance_cp3():
    _check(run_ranks(3, _rank_dsa, ACCEPTANCE, ("deepseek_v32",), deadline=900, pg_timeout=60))


@pytest.mark.slow
def test_dsa_families_cp3_all():
    _check(run_ranks(3, _rank_dsa, TESTED, TESTED, deadline=1800, pg_timeout=60))


# ---- decoding: CP greedy (the KV session, index keys sharded with the K/V) == one process's greedy ----

PROMPT, NEW = 27, 10  # the prompt alone is longer than TOPK: every decoded token's selection is sparse


def _greedy_reference(ref, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's greedy decoding with its own KV cache (transformers' generate): (tokens, raw logits). Not full
    forwards: a DSA model's top-k breaks ties by the row's length, so a token's output after a prefill of the
    prompt alone can differ from its output in one forward over prompt + answer; the cache is what one process
    decodes with, and what the CP session reproduces."""
    ref.generation_config.eos_token_id = None  # exactly `new` tokens
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).float()


def _rank_decode(rank: int, world_size: int, archs: tuple[str, ...]) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for arch in archs:
        ref, model = dsa_pair(arch, dtype=torch.float64)
        ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
        want_tokens, want_logits = _greedy_reference(ref, ids, NEW)
        longdoc.patch(model, cp)
        with small_tiles() as tiles:  # the prefill's query tiles and the decode steps' rows cut in several tiles
            got = longdoc.hf.generate(model, cp, ids, NEW, return_logits=True, eos_token_id=[])  # the ref never stops
        assert tiles.get("dsa", 0) > 0, tiles
        n = min(got.logits.shape[1], want_logits.shape[1])
        results.append((arch, bool(torch.equal(got.tokens, want_tokens)),
                        (got.logits[:, :n] - want_logits[:, :n]).abs().max().item()))
    return results


def _check_decode(world_size: int, archs: tuple[str, ...]) -> None:
    for results in run_ranks(world_size, _rank_decode, archs, deadline=600, pg_timeout=60):
        for arch, same, logit_err in results:
            assert same and logit_err <= 1e-5, (arch, same, logit_err)


def test_dsa_decoding_cp2_equals_single_process():
    _check_decode(2, ("deepseek_v32", "glm_moe_dsa", "dots3_note"))


@pytest.mark.slow
def test_dsa_decoding_cp3_equals_single_process():
    _check_decode(3, TESTED)
