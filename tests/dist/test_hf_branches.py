"""A patched tiny Llama at cp=2 on rows of preference pairs packed as [prompt | chosen | rejected] (sibling
branches, passed to cp.shard_batch as `branches`) equals ONE process running the same rows with eager attention and
the dense 4-D sibling mask: logits, the loss and every parameter gradient, in float64. Rows with different pairs in
one batch, one row alone, ring and ulysses, and activation checkpointing (the recompute attends with its own
batch's pairs). Against the plain document mask (rejected seeing chosen) the same run is far off: the comparison
sees the pairs. One spawn."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longdoc.parallel.layout import Branches
from tests.support.cp_reference import branch_mask, pattern_mask
from tests.support.distributed import run_ranks
from tests.support.hf_cases import cp_pattern_errors, twin_pair

N = 31  # real tokens per row; two tokens after the last pair of row 0
ROWS = (((0, 5, 11, 16), (16, 19, 20, 29)),  # a 1-token rejected
        ((2, 9, 10, 22),))  # a 1-token chosen, tokens before and after the pair
TOL = 1e-5  # float64, but transformers' eager attention takes its softmax in fp32 (~1e-7 measured)


def reference(ref, ids: torch.Tensor, rows, siblings: bool = True) -> tuple:
    """Full logits, mean loss and grads of one process: eager attention with the additive sibling mask, position ids
    per pair (rejected continuing from its prompt), no loss across a document's end or from chosen into rejected.
    siblings=False: the plain document mask instead (each pair one causal document), to show the test sees it."""
    masks, pos, targets = [], [], ids.roll(-1, 1)
    for r, spans in enumerate(rows):
        pairs = Branches(spans)
        seen = branch_mask(N, spans) if siblings else pattern_mask(N, doc_lens=pairs.documents(N).doc_lens)
        masks.append(torch.zeros(N, N, dtype=torch.float64).masked_fill(~seen, float("-inf")))
        pos.append(pairs.position_ids(N))
        targets[r, [e - 1 for e in pairs.documents(N).starts()[1:]]] = -100
        targets[r, [rejected - 1 for _, _, rejected, _ in spans]] = -100
    ref.zero_grad()
    logits = ref(input_ids=ids, attention_mask=torch.stack(masks)[:, None], position_ids=torch.stack(pos)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _errors(ref, model, cp, ids: torch.Tensor, rows, siblings: bool = True) -> tuple[float, float, float]:
    logits, loss, grads = reference(ref, ids, rows, siblings)
    batch = {"input_ids": ids, "labels": ids, "branches": [Branches(s) for s in rows]}
    local = cp.shard_batch(batch)
    padded = local["input_ids"].shape[1] * cp.size
    want, real = [], []
    for r, spans in enumerate(rows):
        docs = Branches(spans).documents(N)
        pack = type(docs)((*docs.doc_lens, padded - N))
        full = torch.zeros(1, padded, logits.shape[-1], dtype=logits.dtype)
        full[0, :N] = logits[r]
        want.append(cp.shard(full, dim=1, documents=pack))
        real.append(cp.shard((torch.arange(padded) < N)[None], dim=1, documents=pack))
    return cp_pattern_errors(model, cp, batch, torch.cat(want), torch.cat(real), loss, grads)


def _cases(rank: int, world_size: int) -> list[tuple]:
    import longdoc
    from longdoc.models.tiny import tiny_config

    cp = longdoc.ContextParallel(timeout=60)
    ids = torch.randint(0, 128, (2, N), generator=torch.Generator().manual_seed(3))
    results = []
    for strategy in ("ring", "ulysses"):
        ref, model = twin_pair(tiny_config("llama"), seed=5, dtype=torch.float64)
        longdoc.patch(model, cp, strategy=strategy)
        results.append((strategy, "two rows", *_errors(ref, model, cp, ids, ROWS)))
        results.append((strategy, "one row", *_errors(ref, model, cp, ids[:1], ROWS[:1])))
    results.append(("ring", "vs the plain document mask", *_errors(ref, model, cp, ids, ROWS, siblings=False)))
    ref, model = twin_pair(tiny_config("llama"), seed=6, dtype=torch.float64)
    model.activation_checkpointing_enable()
    model.train()
    longdoc.patch(model, cp)
    results.append(("ring", "checkpointing", *_errors(ref, model, cp, ids, ROWS)))
    return results


def test_patched_llama_with_branches_equals_one_process_with_the_sibling_mask():
    per_rank = run_ranks(2, _cases, deadline=300)
    assert [len(results) for results in per_rank] == [6, 6]
    plain = "vs the plain document mask"
    bad = [r for results in per_rank for r in results if r[1] != plain and not max(r[2:]) <= TOL]
    assert not bad, bad
    assert all(min(r[2], r[4]) > 1e-3 for results in per_rank for r in results if r[1] == plain)
