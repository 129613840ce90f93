"""Shared pieces of the Hugging Face CP tests: twin models, batches, single-process references and the errors of a
CP step.

From tests/dist/test_hf_cp.py (plain causal LMs, right padding) and tests/dist/test_hf_patterns.py (pattern
families: left padding, packed documents, greedy decoding), so other test modules (test_hf_ulysses.py,
test_hf_linear.py, test_hf_dsa.py, hybrid_cases.py, the model zoos tests/hf_*.py) reuse them without importing a
test module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longdoc.parallel.layout import round_up

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# (name, batch, length, right-padded row lengths or None)
CASES = [
    ("divisible", 1, 48, None),
    ("not-divisible", 1, 45, None),
    ("right-padded-b2", 2, 43, (43, 29)),
]


def eager_causal_lm(config: PretrainedConfig) -> PreTrainedModel:
    """The config's causal LM with eager attention and experts: the reference implementation, and one that runs in
    float64."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")


def twin_pair(config: PretrainedConfig, seed: int, dtype: torch.dtype,
              build: Callable[[PretrainedConfig], PreTrainedModel] = eager_causal_lm,
              ) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference, twin to patch) with identical weights: `build(config)` under `seed`, cast to `dtype`, and a copy.
    The seed is forked, so the caller's random stream does not move."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = build(config)
    ref = ref.to(dtype)
    return ref, copy.deepcopy(ref)


def padded_batch(case, seed: int = 0) -> dict:
    _, bsz, length, lengths = case
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (bsz, length), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if lengths is not None:
        mask = torch.zeros(bsz, length, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        batch["attention_mask"] = mask
    return batch


def reference_step(model, batch):
    """Single-process logits, loss and grads; pads are -100 in the labels (HF convention)."""
    labels = batch["labels"].clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = -100
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def cp_step(model, cp, batch: dict, loss_dtype: torch.dtype | None = None) -> tuple:
    """One CP training step on `model` (patched with `cp`), gradients left in place: (its output, this rank's
    batch, the loss summed over the group, in `loss_dtype` if given, else the model's)."""
    model.zero_grad()
    local = cp.shard_batch(batch)
    out = model(**local)
    out.loss.backward()
    loss = out.loss.detach().to(loss_dtype or out.loss.dtype, copy=True)
    dist.all_reduce(loss, group=cp.group)
    return out, local, loss


def cp_step_errors(model, cp, batch, ref, group=None) -> tuple[float, float, float]:
    """Errors of the CP step on `model` (patched with `cp`) against `ref` = (logits, loss, grads)."""
    ref_logits, ref_loss, ref_grads = ref
    out, _, loss = cp_step(model, cp, batch)
    # grads: sum over the CP group (what a data-parallel all-reduce over the group does)
    grad_err = 0.0
    for n, p in model.named_parameters():
        if n not in ref_grads:
            assert p.grad is None or p.grad.abs().max() == 0, n
            continue
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=cp.group)
        grad_err = max(grad_err, ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item())
    # logits: this rank's shard of the reference, compared on real (non-padded) tokens only
    bsz, length = batch["input_ids"].shape
    padded = round_up(length, cp.multiple)
    real = torch.zeros(bsz, padded, dtype=torch.bool)
    real[:, :length] = batch.get("attention_mask", torch.ones(bsz, length)).bool()
    full = torch.zeros(bsz, padded, ref_logits.shape[-1])
    full[:, :length] = ref_logits
    want, keep = cp.shard(full, dim=1), cp.shard(real, dim=1)
    logit_err = (out.logits.detach() - want)[keep].abs().max().item()
    return logit_err, abs(loss.item() - ref_loss.item()), grad_err



LENGTH, LEAD = 37, 5  # row 1 of the unpacked batch is left-padded by LEAD tokens
DOCS = (13, 1, 9, 17)  # the packed row: a one-token document, and documents crossing every chunk


def rows_of(ids: torch.Tensor, lead: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real ids, their position ids) of each row: what the left-padded row means."""
    return [(ids[r, n:], torch.arange(n, ids.shape[1])) for r, n in enumerate(lead)]


def pieces_reference(ref, pieces: list[tuple[torch.Tensor, torch.Tensor]],
                     forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
    """Every piece run on its own: (logits of each piece, mean loss over all pieces, grads). `forward(ids, pos)`
    gives a piece's logits (seq, vocab); by default `ref` on the piece alone."""
    ref.zero_grad()
    logits, total, count = [], 0.0, 0
    for ids, pos in pieces:
        out = ref(input_ids=ids[None], position_ids=pos[None]).logits[0] if forward is None else forward(ids, pos)
        if ids.numel() > 1:
            total = total + F.cross_entropy(out[:-1].float(), ids[1:], reduction="sum")
            count += ids.numel() - 1
        logits.append(out.detach())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return logits, loss.detach(), grads


def cp_pattern_errors(model, cp, batch, want_logits, real, ref_loss, ref_grads) -> tuple[float, float, float]:
    """(logits, loss, grads) errors of the CP step: want_logits/real are this rank's shard of the
    expected logits and of the tokens that are real."""
    out, _, loss = cp_step(model, cp, batch)
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


def unpacked_case(ref, cp, seed: int, length: int = LENGTH, lead: int = LEAD) -> tuple:
    """Two rows of `length` tokens, row 1 left-padded by `lead`, and their reference on `ref`: (batch, this rank's
    shard of the expected logits, of the real tokens, reference loss, reference grads), as cp_pattern_errors
    takes them after (model, cp)."""
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    leads = [0, lead]
    mask = torch.ones_like(ids)
    mask[1, :lead] = 0
    logits, loss, grads = pieces_reference(ref, rows_of(ids, leads))
    padded = round_up(length, cp.multiple)
    full = torch.zeros(2, padded, logits[0].shape[-1], dtype=logits[0].dtype)
    real = torch.zeros(2, padded, dtype=torch.bool)
    for r, lg in enumerate(logits):  # cp.shard_batch rolls a left-padded row: its real tokens come first
        full[r, :lg.shape[0]] = lg
        real[r, :lg.shape[0]] = True
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask}
    return batch, cp.shard(full, dim=1), cp.shard(real, dim=1), loss, grads


def unpacked_errors(ref, model, cp, seed: int) -> tuple[float, float, float]:
    return cp_pattern_errors(model, cp, *unpacked_case(ref, cp, seed))


def packed_case(ref, cp, seed: int) -> tuple:
    """One row packing the DOCS documents, and their reference on `ref`, as unpacked_case gives them."""
    from transformers import DataCollatorWithFlattening

    from longdoc.parallel.layout import Packed

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in DOCS]
    logits, loss, grads = pieces_reference(ref, [(d, torch.arange(d.numel())) for d in docs])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
    batch = {k: v for k, v in batch.items() if not k.startswith("max_length")}
    total = sum(DOCS)
    packed = Packed(DOCS).pad_to(cp.multiple)
    full = torch.zeros(1, packed.seq_len, logits[0].shape[-1], dtype=logits[0].dtype)
    full[0, :total] = torch.cat(logits)
    real = torch.zeros(1, packed.seq_len, dtype=torch.bool)
    real[0, :total] = True
    return batch, cp.shard(full, dim=1, documents=packed), cp.shard(real, dim=1, documents=packed), loss, grads


def packed_errors(ref, model, cp, seed: int) -> tuple[float, float, float]:
    return cp_pattern_errors(model, cp, *packed_case(ref, cp, seed))



PROMPT, NEW = 29, 12  # prompt + new tokens cross the 7-token window several times


def greedy_reference(ref, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def session_tokens(ref, model, cp, ids: torch.Tensor, question: torch.Tensor, new: int,
                   **generate) -> tuple[list[int], list[int]]:
    """The KV session's mark / extend / rollback on the patched `model`, against the unpatched `ref`: (want, got).

    `question` extended after the prompt `ids`, twice with a rollback between, predicts the token one forward over
    prompt + question does; rolled back again, greedy decoding of `new` tokens from the prompt equals
    ref.generate(ids, **generate)."""
    import longdoc.hf

    with torch.no_grad():
        full = ref(input_ids=torch.cat([ids, question], dim=1)).logits[0, -1].argmax().item()
    with longdoc.hf.KVSession(model, cp) as s:
        first = s.prefill(ids)
        mark = s.mark()
        a = s.extend(question)[0, -1].argmax().item()
        s.rollback(mark)
        b = s.extend(question)[0, -1].argmax().item()
        s.rollback(mark)
        again = s.greedy(first, new).tokens[0].tolist()
    want = ref.generate(ids, max_new_tokens=new, do_sample=False, **generate)[0, ids.shape[1]:].tolist()
    return [full, full] + want, [a, b] + again
