"""Model families with attention patterns (sliding windows shorter than the sequence, sinks, soft-capping,
Llama 4 chunks) patched under CP (gloo, 2 and 3 ranks) against single-process references, packed and
unpacked, outputs and gradients; and CP greedy decoding against single-process greedy decoding.

References are the definitions: every row (left padding dropped, every token at its position) or every
packed document run on its own by the unpatched twin with eager attention. One spawn per world size;
every family and case runs inside it, and the test process asserts, listing every failure at once.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.hf_cases import LEAD, LENGTH, NEW, PROMPT, greedy_reference, packed_errors, rows_of, unpacked_errors
from tests.support.hf_families import CORE_FAMILIES, FAMILIES, check_model_errors, family_pair


def _rank_families(rank: int, world_size: int, archs: tuple[str, ...]) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for i, arch in enumerate(archs):
        ref, model = family_pair(arch)
        longdoc.patch(model, cp)
        results.append((arch, "unpacked+left-pad", *unpacked_errors(ref, model, cp, seed=10 + i)))
        results.append((arch, "packed", *packed_errors(ref, model, cp, seed=50 + i)))
    # activation checkpointing: the recompute in backward sees its own batch's documents
    ref, model = family_pair("gemma3_text")
    model.activation_checkpointing_enable()
    model.train()
    longdoc.patch(model, cp)
    results.append(("gemma3_text", "packed+checkpointing", *packed_errors(ref, model, cp, seed=70)))
    # the other strategy and layout, on two families that bring windows, sinks and soft-capping
    contiguous = longdoc.ContextParallel(layout="contiguous", timeout=60)
    for arch in ("gpt_oss", "gemma2"):
        ref, model = family_pair(arch)
        longdoc.patch(model, contiguous, strategy="allgather")
        results.append((arch, "allgather+contiguous", *unpacked_errors(ref, model, contiguous, seed=90)))
        results.append((arch, "allgather+contiguous packed", *packed_errors(ref, model, contiguous, seed=91)))
    return results


def test_families_cp2():
    per_rank = run_ranks(2, _rank_families, tuple(FAMILIES), deadline=600, pg_timeout=60)
    assert len(per_rank[0]) == 2 * len(FAMILIES) + 5
    check_model_errors(per_rank)


def test_families_cp3_core():
    check_model_errors(run_ranks(3, _rank_families, CORE_FAMILIES, deadline=600, pg_timeout=60))


@pytest.mark.slow
def test_families_cp3_all():
    check_model_errors(run_ranks(3, _rank_families, tuple(FAMILIES), deadline=900, pg_timeout=60))


# ---- decoding: CP greedy == single-process greedy, token for token ----


def _rank_decode(rank: int, world_size: int) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for arch in ("gemma3_text", "gpt_oss", "gemma2", "llama4_text"):
        ref, model = family_pair(arch, dtype=torch.float64)
        ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
        want_tokens, want_logits = greedy_reference(ref, ids, NEW)
        longdoc.patch(model, cp)
        got = longdoc.hf.generate(model, cp, ids, NEW, return_logits=True, eos_token_id=[])  # the reference never stops
        same = bool(torch.equal(got.tokens, want_tokens))
        n = min(got.logits.shape[1], want_logits.shape[1])
        results.append((arch, same, (got.logits[:, :n] - want_logits[:, :n]).abs().max().item()))
    results += _prefill_positions(cp)
    # left-padded prompts of unequal length: each decodes as it does alone (pads see nothing)
    ref, model = family_pair("gemma3_text", dtype=torch.float64)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :LEAD] = 0
    got = longdoc.hf.generate(model, cp, ids, NEW, attention_mask=mask, eos_token_id=[])
    for r, n in enumerate((0, LEAD)):
        want, _ = greedy_reference(ref, ids[r:r + 1, n:], NEW)
        results.append((f"left-padded generate row {r}", bool(torch.equal(got.tokens[r:r + 1], want)), 0.0))
    return results


def _prefill_positions(cp) -> list[tuple]:
    """Evaluation prefill at chosen positions of a left-padded and of a packed batch (Gemma 3, window 7)."""
    import longdoc
    from longdoc.hf.prefill import prefill

    ref, model = family_pair("gemma3_text", dtype=torch.float64)
    longdoc.patch(model, cp)
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :LEAD] = 0
    at = torch.tensor([[3, 20, LENGTH - 1], [LEAD, 20, LENGTH - 1]])  # real tokens of each row
    got = prefill(model, cp, {"input_ids": ids, "attention_mask": mask}, positions=at)
    err = 0.0
    with torch.no_grad():
        for r, (row, pos) in enumerate(rows_of(ids, [0, LEAD])):
            want = ref(input_ids=row[None], position_ids=pos[None]).logits[0]
            err = max(err, (got[r] - want[at[r] - int(pos[0])]).abs().max().item())
    docs = [ids[0, :11], ids[0, 11:12], ids[0, 12:]]
    packed = {"input_ids": ids[:1], "position_ids": torch.cat([torch.arange(d.numel()) for d in docs])[None]}
    at = torch.tensor([4, 11, 12, 30])
    got = prefill(model, cp, packed, positions=at)[0]
    with torch.no_grad():
        want = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])[at]
    return [("prefill left-padded", True, err), ("prefill packed", True, (got - want).abs().max().item())]


def test_decoding_with_patterns_cp2_equals_single_process():
    per_rank = run_ranks(2, _rank_decode, deadline=600, pg_timeout=60)
    for results in per_rank:
        for arch, same, logit_err in results:
            assert same and logit_err <= 1e-5, (arch, same, logit_err)


@pytest.mark.slow
def test_decoding_with_patterns_cp3_equals_single_process():
    for results in run_ranks(3, _rank_decode, deadline=900, pg_timeout=60):
        for arch, same, logit_err in results:
            assert same and logit_err <= 1e-5, (arch, same, logit_err)
