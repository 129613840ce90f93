"""Linear-attention and recurrent families (Gated DeltaNet, KDA, lightning, RG-LRU, RWKV-4, mLSTM) patched under
CP (gloo, 2, 3 and 4 ranks) against single-process references: logits, loss and every gradient, unpacked (a
left-padded row) and packed, both layouts and strategies, fp32 and bf16.

References are the definitions: every row (left padding dropped) or every packed document run on its own by the
unpatched twin. One spawn per world size; every family and case runs inside it, and the test process asserts,
listing every failure at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_ranks
from tests.support.hf_cases import (
    LEAD,
    LENGTH,
    cp_step,
    packed_case,
    pieces_reference,
    rows_of,
    session_tokens,
    unpacked_case,
)
from tests.support.hf_hybrids_linear import FAMILIES, float64_delta_rule, linear_pair

# Batches from tests.support.hf_cases: rows of LENGTH tokens, one left-padded by LEAD, and a packed row of DOCS (a
# one-token document, shorter than the conv kernel, and documents crossing chunks).
# logits (max abs), loss (rel), grads (max abs error / max abs, per parameter), all grads (rel L2 norm)
# float64: the attention layers' CP softmax merges in fp32 (docs/design.md), so 1e-7-level agreement, not 1e-15.
# bfloat16: errors against the fp32 reference as RATIOS to one bf16 process's own errors against it (a bf16 run of
# these tiny models is itself up to ~1.5 off in logits): CP in bf16 must be no worse than one process in bf16.
TOL = {torch.float64: (1e-5, 1e-6, 1e-4, 1e-6), torch.float32: (1e-4, 1e-5, 1e-4, 1e-5),
       torch.bfloat16: (2.0, 2.0, float("inf"), 2.0)}
# The delta-rule chunk kernels compute in fp32 whatever the model's dtype, from cumulative log decays: the decay
# gates' own (small, cancelling) gradients move by up to 2.6e-4 relative in ONE process when only the kernel's
# chunk size changes (Qwen4-exp, 64 vs 8). So the delta families are compared in float64 with the kernel swapped
# for its float64 definition (tests.support.hf_hybrids_linear.float64_delta_rule: CP == one process to the attention
# core's fp32 merge); the "fp32 kernel" cases run transformers' own kernel, with a per-parameter bound at its spread.
DELTA_GRAD_TOL = 1e-3
# ...and tightly, as ratios: CP with transformers' fp32 kernel against the float64 definition, over one process with
# that kernel against it (_fp32_kernel). CP's pieces start the kernel's chunks at other places and add the entering
# state in fp32, no worse than one process's own fp32 rounding (measured: 0.2-1.05x at CP 2)
RATIO = "fp32 kernel ratio"
TOL[RATIO] = (2.0, 2.0, 2.0, 2.0)
DELTA = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini", "qwen4_exp_text",
         "kimi_linear", "bailing_hybrid", "glm5_next"}

# One family per kind in the default suite (all families, and 4 ranks, in the slow one); Qwen3-Next's 2 key heads
# and Kimi Linear's 4 heads put every world size here at or above a head count.
CORE = ("qwen3_next", "kimi_linear", "minimax", "recurrent_gemma", "rwkv", "xlstm")


def _errors(model, cp, batch, want_logits, real, ref_loss, ref_grads):
    """As tests.support.hf_cases.cp_pattern_errors, but in fp32 (loss and grads summed and compared there), the loss
    error relative, and a 4th error: all grads together (relative L2 norm)."""
    out, _, loss = cp_step(model, cp, batch, loss_dtype=torch.float32)
    grad_err, diff2, ref2 = 0.0, 0.0, 0.0
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        g = p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        dist.all_reduce(g, group=cp.group)
        want = ref_grads[n].float()
        grad_err = max(grad_err, ((g - want).abs().max() / want.abs().max().clamp_min(1e-6)).item())
        diff2, ref2 = diff2 + (g - want).double().pow(2).sum().item(), ref2 + want.double().pow(2).sum().item()
    logit_err = (out.logits.detach().float() - want_logits.float())[real].abs().max().item()
    loss_err = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-6)
    return logit_err, loss_err, grad_err, (diff2 / max(ref2, 1e-30)) ** 0.5


def _bf16(arch: str, cp, seed: int) -> tuple[float, ...]:
    """CP in bf16 and one bf16 process, both against the fp32 reference: the ratios of their errors."""
    import longdoc

    ref32, _ = linear_pair(arch)
    ref16, model = linear_pair(arch, dtype=torch.bfloat16)
    longdoc.patch(model, cp)
    cp_errors = _unpacked(ref32, model, cp, seed)
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(seed))  # _unpacked's batch
    rows = rows_of(ids, [0, LEAD])
    (l32, loss32, g32), (l16, loss16, g16) = pieces_reference(ref32, rows), pieces_reference(ref16, rows)
    diff2 = sum((g16[n].float() - g).double().pow(2).sum().item() for n, g in g32.items())
    one_errors = (max((a.float() - b).abs().max().item() for a, b in zip(l16, l32)),
                  abs(loss16.item() - loss32.item()) / abs(loss32.item()),
                  max(((g16[n].float() - g).abs().max() / g.abs().max().clamp_min(1e-6)).item()
                      for n, g in g32.items()),
                  (diff2 / sum(g.double().pow(2).sum().item() for g in g32.values())) ** 0.5)
    return tuple(a / max(b, 1e-6) for a, b in zip(cp_errors, one_errors))


def _fp32_kernel(arch: str, cp, seed: int) -> tuple[float, ...]:
    """CP with transformers' own fp32 chunk kernel, and one process with it, both against the float64 definition
    (float64_delta_rule): the ratios of their errors (floors: 1e-6 logits and loss, 1e-5 grads)."""
    import longdoc

    ref64, _ = linear_pair(arch, dtype=torch.float64)
    ref32, model = linear_pair(arch)
    longdoc.patch(model, cp)
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(seed))  # unpacked_case's batch
    rows = rows_of(ids, [0, LEAD])
    with float64_delta_rule(arch):
        case = unpacked_case(ref64, cp, seed, LENGTH, LEAD)
        l64, loss64, g64 = pieces_reference(ref64, rows)
    cp_errors = _errors(model, cp, *case)
    l32, loss32, g32 = pieces_reference(ref32, rows)
    diff2 = sum((g32[n].double() - g).pow(2).sum().item() for n, g in g64.items())
    one_errors = (max((a.double() - b).abs().max().item() for a, b in zip(l32, l64)),
                  abs(loss32.item() - loss64.item()) / abs(loss64.item()),
                  max(((g32[n].double() - g).abs().max() / g.abs().max().clamp_min(1e-6)).item()
                      for n, g in g64.items()),
                  (diff2 / sum(g.pow(2).sum().item() for g in g64.values())) ** 0.5)
    return tuple(a / max(b, f) for a, b, f in zip(cp_errors, one_errors, (1e-6, 1e-6, 1e-5, 1e-6)))


def _unpacked(ref, model, cp, seed: int, length: int = LENGTH, lead: int = LEAD):
    return _errors(model, cp, *unpacked_case(ref, cp, seed, length, lead))


def _packed(ref, model, cp, seed: int):
    return _errors(model, cp, *packed_case(ref, cp, seed))


XLSTM_LEN = 96  # whole 4-token chunks per piece at 2, 3 and 4 ranks (zigzag: 4, 6, 8 pieces)


def _xlstm_refusals(model, cp) -> list[tuple]:
    """A length whose pieces are not whole chunks, and a packed row, are refused by name, on every rank."""
    from longdoc.hf import UnsupportedFeatureError
    from longdoc.parallel.batch import CPInputError

    out = []
    ids = torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    packed = {"input_ids": ids[:, :24], "labels": ids[:, :24],
              "position_ids": torch.cat([torch.arange(12), torch.arange(12)])[None]}
    for case, batch, error, words in (("refused: pieces not whole chunks", {"input_ids": ids, "labels": ids},
                                       CPInputError, "whole chunks of chunk_size=4"),
                                      ("refused: packed", packed, UnsupportedFeatureError, "packed rows")):
        try:
            model(**cp.shard_batch(batch))
            ok = False
        except error as e:
            ok = words in str(e)
        out.append(("xlstm", case, torch.float32, 0.0 if ok else float("inf"), 0.0, 0.0, 0.0))
    return out


def _rank_families(rank: int, world_size: int, archs: tuple[str, ...], extra: tuple[str, ...]) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for i, arch in enumerate(archs):
        if arch in DELTA:  # float64 throughout, the delta rule's fp32 chunk kernel swapped for its definition
            with float64_delta_rule(arch):
                ref, model = linear_pair(arch, dtype=torch.float64)
                longdoc.patch(model, cp)
                results.append((arch, "unpacked+left-pad", torch.float64, *_unpacked(ref, model, cp, seed=10 + i)))
                results.append((arch, "packed", torch.float64, *_packed(ref, model, cp, seed=50 + i)))
            continue
        ref, model = linear_pair(arch)
        longdoc.patch(model, cp)
        if arch == "xlstm":  # whole chunks per piece only (see _xlstm_refusals), so no padding
            results.append((arch, "unpacked", torch.float32, *_unpacked(ref, model, cp, 10 + i, XLSTM_LEN, 0)))
            results += _xlstm_refusals(model, cp)
            continue
        results.append((arch, "unpacked+left-pad", torch.float32, *_unpacked(ref, model, cp, seed=10 + i)))
        results.append((arch, "packed", torch.float32, *_packed(ref, model, cp, seed=50 + i)))
    for arch in extra:  # transformers' own fp32 chunk kernel, as users run it
        ref, model = linear_pair(arch)
        longdoc.patch(model, cp)
        results.append((arch, "fp32 kernel", torch.float32, *_unpacked(ref, model, cp, seed=94)))
        results.append((arch, "fp32 kernel packed", torch.float32, *_packed(ref, model, cp, seed=95)))
    if extra:  # activation checkpointing (the recompute sees its own documents), the other layout and strategy, bf16
        ref, model = linear_pair(extra[0])
        model.activation_checkpointing_enable()
        model.train()
        longdoc.patch(model, cp)
        results.append((extra[0], "packed+checkpointing", torch.float32, *_packed(ref, model, cp, seed=70)))
        contiguous = longdoc.ContextParallel(layout="contiguous", timeout=60)
        for arch in extra:
            ref, model = linear_pair(arch)
            longdoc.patch(model, contiguous, strategy="allgather")
            results.append((arch, "allgather+contiguous", torch.float32, *_unpacked(ref, model, contiguous, 90)))
            results.append((arch, "contiguous packed", torch.float32, *_packed(ref, model, contiguous, 91)))
            results.append((arch, "bf16 (ratios to one bf16 process)", torch.bfloat16, *_bf16(arch, cp, seed=92)))
            if arch in DELTA:
                results.append((arch, "fp32 kernel (ratios to one fp32-kernel process, vs float64)", RATIO,
                                *_fp32_kernel(arch, cp, seed=93)))
    return results


def check(per_rank: list[list[tuple]]) -> None:
    failures = []
    for results in per_rank:
        for arch, case, dtype, logit_err, loss_err, grad_err, grad_norm in results:
            errors = (logit_err, loss_err, grad_err, grad_norm)
            tol = list(TOL[dtype])
            if arch in DELTA and dtype == torch.float32:
                tol[2] = DELTA_GRAD_TOL
            if not all(e <= t for e, t in zip(errors, tol)):
                failures.append(f"{arch} {case}: logits {logit_err:.2e} loss {loss_err:.2e} grads {grad_err:.2e} "
                                f"(all grads {grad_norm:.2e})")
    assert not failures, "CP differs from the single-process reference:\n" + "\n".join(sorted(set(failures)))


def test_linear_families_cp2_core():
    check(run_ranks(2, _rank_families, CORE, ("qwen3_next",), deadline=900, pg_timeout=60))


def test_linear_families_cp3_core():
    check(run_ranks(3, _rank_families, ("qwen3_next", "rwkv"), (), deadline=600, pg_timeout=60))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_linear_families_all(world):
    check(run_ranks(world, _rank_families, tuple(FAMILIES), ("qwen3_next", "kimi_linear"), deadline=2400,
                    pg_timeout=120))


# ---- decoding: greedy after a CP prefill == single-process model.generate, token for token ----

DECODE = ("qwen3_next", "kimi_linear")  # Gated DeltaNet and KDA: state and conv cache carried into decoding
NEW = 8


def _rank_decode(rank: int, world_size: int, archs: tuple[str, ...]) -> dict:
    import longdoc
    import longdoc.hf

    cp = longdoc.ContextParallel(timeout=120)
    out = {}
    for arch in archs:
        ref, model = linear_pair(arch)
        ref.eval()
        model.eval()
        longdoc.patch(model, cp)
        for length in (37, 5):  # 5: fewer tokens per rank than the conv kernel
            ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
            want = ref.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)[0, length:].tolist()
            got = model.generate(ids, max_new_tokens=NEW)[0, length:].tolist()  # routed to the CP session
            out[(arch, f"generate/{length}")] = (want, got)
        # the session's mark / extend / rollback copies the recurrent and conv states
        ids = torch.randint(0, 256, (1, 29), generator=torch.Generator().manual_seed(3))
        question = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
        out[(arch, "session")] = session_tokens(ref, model, cp, ids, question, NEW, min_new_tokens=NEW)
    # decoding a family whose state the session does not carry is refused by name, on every rank
    ref, model = linear_pair("minimax")
    longdoc.patch(model, cp)
    try:
        model.generate(torch.zeros(1, 8, dtype=torch.long), max_new_tokens=2)
        out[("minimax", "refused")] = ("refused", "decoded")
    except longdoc.hf.UnsupportedFeatureError as e:
        out[("minimax", "refused")] = ("refused", "refused" if "lightning layers in a KV session" in str(e) else str(e))
    return out


@pytest.mark.parametrize("archs", [DECODE[:1], pytest.param(DECODE, marks=pytest.mark.slow)], ids=["core", "all"])
def test_greedy_after_cp_prefill_equals_one_process(archs):
    per_rank = run_ranks(2, _rank_decode, archs, deadline=900, pg_timeout=120)
    bad = [f"rank {r} {k}: want {w} got {g}" for r, res in enumerate(per_rank) for k, (w, g) in res.items() if w != g]
    assert not bad, "\n".join(bad)
    assert len(per_rank[0]) == 3 * len(archs) + 1
