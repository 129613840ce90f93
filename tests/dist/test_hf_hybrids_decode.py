"""Greedy decoding of hybrid models after a CP prefill equals single-process model.generate token for token:
the recurrent and conv states of the CP prefill (gathered to every rank) carry into decoding. Also the KV
session's mark / extend / rollback, which copies recurrent states, and prompts shorter than the conv kernel
per rank. Every decoded step's logits too (float64 models): against greedy decoding by full forwards of prompt +
tokens so far (the definition, no cache), so a wrong state shows at the step it enters, not only when it flips an
argmax of the random 256-token vocabulary. One spawn per world size."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_ranks
from tests.support.hf_cases import greedy_reference, session_tokens
from tests.support.hf_hybrids import hybrid_pair

ARCHS = ("mamba2", "granitemoehybrid", "falcon_h1", "nemotron_h", "jamba", "zamba", "lfm2", "lfm3", "zaya")
NEW = 8
LOGITS_TOL = 1e-5  # float64 models; the session hands its logits back in fp32 (rounding: 5e-7 here)


def _ids(length: int, seed: int) -> torch.Tensor:
    # No special ids: transformers' generate would mask a pad id inside the prompt, and stop at an EOS.
    return torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(seed))


def _rank(rank, world, archs):
    import longdoc

    cp = longdoc.ContextParallel(timeout=120)
    out = {}
    for arch in archs:
        ref, model = hybrid_pair(arch, dtype=torch.float64)
        for m in (ref, model):
            m.eval()
            m.generation_config.eos_token_id = None
        longdoc.patch(model, cp)
        for length in (37, 5):
            ids = _ids(length, length)
            want = ref.generate(ids, max_new_tokens=NEW, do_sample=False)[0, length:].tolist()
            got = model.generate(ids, max_new_tokens=NEW)[0, length:].tolist()  # routed to the CP session
            out[(arch, f"generate/{length}")] = (want, got)
            want_tokens, want_logits = greedy_reference(ref, ids, NEW)
            steps = longdoc.hf.generate(model, cp, ids, NEW, return_logits=True, eos_token_id=[])
            err = (steps.logits.double() - want_logits.double()).abs().max().item()
            out[(arch, f"logits/{length}")] = (want_tokens[0].tolist() + [True],
                                               steps.tokens[0].tolist() + [err <= LOGITS_TOL or err])
        out[(arch, "session")] = session_tokens(ref, model, cp, _ids(29, 3), _ids(6, 4), NEW)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_after_cp_prefill_equals_one_process(world):
    per_rank = run_ranks(world, _rank, ARCHS, deadline=1200)
    bad = [f"rank {r} {k}: want {w} got {g}" for r, res in enumerate(per_rank) for k, (w, g) in res.items() if w != g]
    assert not bad, "\n".join(bad)  # a logits/ entry ends with True, or with the step logits' error
    assert len(per_rank[0]) == 5 * len(ARCHS)
