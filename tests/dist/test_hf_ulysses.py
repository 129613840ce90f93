"""Patched Hugging Face models with strategy "ulysses" (cp=2, and cp=4 where 2 K/V heads are replicated over 4
ranks) and "usp" 2 x 2 (cp=4) against single-process references: the pattern families (windows, sinks,
soft-capping, Llama 4 chunks), left-padded and packed rows, outputs and gradients; the plain tiny architectures;
and greedy decoding through the KV session (Ulysses prefill, then decoding over the sharded cache) token for
token. One spawn per world size."""

from __future__ import annotations

import torch

from tests.support.distributed import run_ranks
from tests.support.hf_cases import (
    CASES,
    NEW,
    PROMPT,
    cp_step_errors,
    greedy_reference,
    packed_errors,
    padded_batch,
    reference_step,
    unpacked_errors,
)
from tests.support.hf_families import CORE_FAMILIES, check_model_errors, family_pair


def _grids(world_size: int) -> list[tuple[str, int | None, tuple[str, ...], tuple[str, ...]]]:
    """(strategy, ulysses_size, pattern families, plain tiny architectures) per spawn: cp=2 runs ulysses on all of
    them; cp=4 runs usp 2 x 2 on all, and ulysses (2 K/V heads replicated over 4 ranks) on GPT-OSS's sinks."""
    from longdoc.models import TINY_ARCHS

    if world_size == 2:
        return [("ulysses", None, CORE_FAMILIES, TINY_ARCHS)]
    return [("usp", 2, CORE_FAMILIES, TINY_ARCHS), ("ulysses", None, ("gpt_oss",), ("qwen2_moe",))]


def _rank(rank: int, world_size: int) -> dict:
    import longdoc
    from longdoc import models

    models_out, decode = [], []
    for strategy, u, families, archs in _grids(world_size):
        cp = longdoc.ContextParallel(timeout=60, ulysses_size=u)
        label = f"{strategy}{u or ''}"
        for i, arch in enumerate(families):
            ref, model = family_pair(arch)
            longdoc.patch(model, cp, strategy=strategy)
            models_out.append((arch, f"{label} unpacked+left-pad", *unpacked_errors(ref, model, cp, seed=10 + i)))
            models_out.append((arch, f"{label} packed", *packed_errors(ref, model, cp, seed=50 + i)))
        for arch in archs:  # plain causal LMs (4 query / 2 K/V heads), right padding, batch 2
            ref_model = models.tiny_model(arch, seed=1)
            model = longdoc.patch(models.tiny_model(arch, seed=1), cp, strategy=strategy)
            batch = padded_batch(CASES[2])
            models_out.append((arch, f"{label} right-padded-b2", *cp_step_errors(model, cp, batch,
                                                                           reference_step(ref_model, batch))))
        for arch in ("gemma3_text", "gpt_oss")[-len(families):]:  # windows, sinks: the prefill and every step
            ref, model = family_pair(arch, dtype=torch.float64)
            ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
            want_tokens, want_logits = greedy_reference(ref, ids, NEW)
            longdoc.patch(model, cp, strategy=strategy)
            got = longdoc.hf.generate(model, cp, ids, NEW, return_logits=True, strategy=strategy)
            n = min(got.logits.shape[1], want_logits.shape[1])
            decode.append((arch, label, bool(torch.equal(got.tokens, want_tokens)),
                           (got.logits[:, :n] - want_logits[:, :n]).abs().max().item()))
    return {"models": models_out, "decode": decode}


def _check(per_rank: list[dict], world_size: int) -> None:
    assert len(per_rank[0]["models"]) == sum(2 * len(f) + len(a) for _, _, f, a in _grids(world_size))
    assert len(per_rank[0]["decode"]) == sum(min(2, len(f)) for _, _, f, _ in _grids(world_size))
    check_model_errors([r["models"] for r in per_rank])
    for r in per_rank:
        for arch, label, same, logit_err in r["decode"]:
            assert same and logit_err <= 1e-5, (arch, label, same, logit_err)


def test_ulysses_cp2_models_and_decoding_equal_single_process():
    _check(run_ranks(2, _rank, deadline=900, pg_timeout=60), 2)


def test_ulysses_and_usp_cp4_models_and_decoding_equal_single_process():
    _check(run_ranks(4, _rank, deadline=1200, pg_timeout=60), 4)
