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
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_ranks
from tests.hf_families import CORE_FAMILIES, FAMILIES, check_model_errors, family_pair

LENGTH, LEAD = 37, 5  # row 1 of the unpacked batch is left-padded by LEAD tokens
DOCS = (13, 1, 9, 17)  # the packed row: a one-token document, and documents crossing every chunk


def _rows(ids: torch.Tensor, lead: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real ids, their position ids) of each row: what the left-padded row means."""
    return [(ids[r, n:], torch.arange(n, ids.shape[1])) for r, n in enumerate(lead)]


def _reference(ref, pieces: list[tuple[torch.Tensor, torch.Tensor]]):
    """Every piece run on its own: (logits of each piece, mean loss over all pieces, grads)."""
    ref.zero_grad()
    logits, total, count = [], 0.0, 0
    for ids, pos in pieces:
        out = ref(input_ids=ids[None], position_ids=pos[None]).logits[0]
        if ids.numel() > 1:
            total = total + F.cross_entropy(out[:-1].float(), ids[1:], reduction="sum")
            count += ids.numel() - 1
        logits.append(out.detach())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return logits, loss.detach(), grads


def _errors(model, cp, batch, want_logits, real, ref_loss, ref_grads) -> tuple[float, float, float]:
    """(logits, loss, grads) errors of the CP step: want_logits/real are this rank's shard of the
    expected logits and of the tokens that are real."""
    model.zero_grad()
    out = model(**cp.shard_batch(batch))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    grad_err = 0.0
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=cp.group)
        scale = ref_grads[n].abs().max().clamp_min(1e-6)
        grad_err = max(grad_err, ((g - ref_grads[n]).abs().max() / scale).item())
    logit_err = (out.logits.detach().to(want_logits.dtype) - want_logits)[real].abs().max().item()
    return logit_err, abs(loss.item() - ref_loss.item()), grad_err


def _unpacked(ref, model, cp, seed: int) -> tuple[float, float, float]:
    ids = torch.randint(0, 256, (2, LENGTH), generator=torch.Generator().manual_seed(seed))
    lead = [0, LEAD]
    mask = torch.ones_like(ids)
    mask[1, :LEAD] = 0
    logits, loss, grads = _reference(ref, _rows(ids, lead))
    padded = -(-LENGTH // cp.multiple) * cp.multiple
    full = torch.zeros(2, padded, logits[0].shape[-1], dtype=logits[0].dtype)
    real = torch.zeros(2, padded, dtype=torch.bool)
    for r, lg in enumerate(logits):  # cp.shard_batch rolls a left-padded row: its real tokens come first
        full[r, :lg.shape[0]] = lg
        real[r, :lg.shape[0]] = True
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    return _errors(model, cp, batch, cp.shard(full, dim=1), cp.shard(real, dim=1), loss, grads)


def _packed(ref, model, cp, seed: int) -> tuple[float, float, float]:
    from transformers import DataCollatorWithFlattening

    from longdoc.parallel.layout import Packed

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in DOCS]
    logits, loss, grads = _reference(ref, [(d, torch.arange(d.numel())) for d in docs])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
    batch = {k: v for k, v in batch.items() if not k.startswith("max_length")}
    total = sum(DOCS)
    packed = Packed(DOCS).pad_to(cp.multiple)
    full = torch.zeros(1, packed.seq_len, logits[0].shape[-1], dtype=logits[0].dtype)
    full[0, :total] = torch.cat(logits)
    real = torch.zeros(1, packed.seq_len, dtype=torch.bool)
    real[0, :total] = True
    want = cp.shard(full, dim=1, documents=packed)
    return _errors(model, cp, batch, want, cp.shard(real, dim=1, documents=packed), loss, grads)


def _rank_families(rank: int, world_size: int, archs: tuple[str, ...]) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for i, arch in enumerate(archs):
        ref, model = family_pair(arch)
        longdoc.patch(model, cp)
        results.append((arch, "unpacked+left-pad", *_unpacked(ref, model, cp, seed=10 + i)))
        results.append((arch, "packed", *_packed(ref, model, cp, seed=50 + i)))
    # activation checkpointing: the recompute in backward sees its own batch's documents
    ref, model = family_pair("gemma3_text")
    model.activation_checkpointing_enable()
    model.train()
    longdoc.patch(model, cp)
    results.append(("gemma3_text", "packed+checkpointing", *_packed(ref, model, cp, seed=70)))
    # the other strategy and layout, on two families that bring windows, sinks and soft-capping
    contiguous = longdoc.ContextParallel(layout="contiguous", timeout=60)
    for arch in ("gpt_oss", "gemma2"):
        ref, model = family_pair(arch)
        longdoc.patch(model, contiguous, strategy="allgather")
        results.append((arch, "allgather+contiguous", *_unpacked(ref, model, contiguous, seed=90)))
        results.append((arch, "allgather+contiguous packed", *_packed(ref, model, contiguous, seed=91)))
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

PROMPT, NEW = 29, 12  # prompt + new tokens cross the 7-token window several times


def _greedy_reference(ref, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by full forwards (no cache): the definition. (tokens (1, new), logits (1, new, V))."""
    seq, tokens, logits = ids, [], []
    with torch.no_grad():
        for _ in range(new):
            last = ref(input_ids=seq).logits[:, -1].float()
            nxt = last.argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits.append(last)
            seq = torch.cat([seq, nxt], dim=1)
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def _rank_decode(rank: int, world_size: int) -> list[tuple]:
    import longdoc

    cp = longdoc.ContextParallel(timeout=60)
    results = []
    for arch in ("gemma3_text", "gpt_oss", "gemma2", "llama4_text"):
        ref, model = family_pair(arch, dtype=torch.float64)
        ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
        want_tokens, want_logits = _greedy_reference(ref, ids, NEW)
        longdoc.patch(model, cp)
        got = longdoc.hf.generate(model, cp, ids, NEW, return_logits=True)
        same = bool(torch.equal(got.tokens, want_tokens))
        n = min(got.logits.shape[1], want_logits.shape[1])
        results.append((arch, same, (got.logits[:, :n] - want_logits[:, :n]).abs().max().item()))
    results += _prefill_positions(cp)
    # left-padded prompts of unequal length: each decodes as it does alone (pads see nothing)
    ref, model = family_pair("gemma3_text", dtype=torch.float64)
    ids = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :LEAD] = 0
    got = longdoc.hf.generate(model, cp, ids, NEW, attention_mask=mask)
    for r, n in enumerate((0, LEAD)):
        want, _ = _greedy_reference(ref, ids[r:r + 1, n:], NEW)
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
        for r, (row, pos) in enumerate(_rows(ids, [0, LEAD])):
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
