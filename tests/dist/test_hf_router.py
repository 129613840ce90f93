"""The MoE router auxiliary loss (output_router_logits=True) under CP against one process: loss, aux loss and every
gradient, padded and packed rows, for attention MoE models and hybrid ones (Jamba, Granite-4-H, Qwen3-Next), at cp=2
and at dp=2 x cp=2 (each replica's loss is its own batch's: the router statistics are summed over the CP group
only).

References: transformers' own forward in one process; a padded batch with its attention_mask (which leaves the
pads out of the router statistics), a packed row as its documents run on their own, their router logits
concatenated into transformers' own load_balancing_loss_func.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.distributed import run_ranks

LENGTH, PAD = 23, 6  # row 1 is right-padded by PAD tokens; 23 is not a multiple of cp.multiple
DOCS = (9, 1, 13)
TOL = 1e-5
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=1024, initializer_range=0.1, num_local_experts=4,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
             router_aux_loss_coef=0.7, tie_word_embeddings=False)
ARCHS = ("mixtral", "qwen3_moe", "gpt_oss")


# hybrid MoE models (Mamba / Gated DeltaNet layers beside attention): the router loss beside state passing
HYBRID_ARCHS = ("jamba", "granitemoehybrid", "qwen3_next")


def _config(arch: str):
    router = dict(output_router_logits=True, router_aux_loss_coef=0.7)
    if arch == "qwen3_next":
        from tests.support.hf_hybrids_linear import linear_config

        return linear_config(arch, **router)
    if arch in HYBRID_ARCHS:
        from tests.support.hf_hybrids import hybrid_config

        return hybrid_config(arch, **router)
    return AutoConfig.for_model(arch, **{k: v for k, v in _TINY.items()})


def _pair(arch: str):
    config = _config(arch)
    for key, value in vars(config).items():
        if key.endswith("dropout") and isinstance(value, float):
            setattr(config, key, 0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return ref, copy.deepcopy(ref)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def _padded_reference(ref, ids, mask):
    ref.zero_grad()
    out = ref(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return out.loss.item(), out.aux_loss.item(), _grads(ref)


def _packed_reference(ref, docs):
    ref.zero_grad()
    lb = sys.modules[type(ref).__module__].load_balancing_loss_func
    total, count, logits = 0.0, 0, []
    for d in docs:
        out = ref(input_ids=d[None])
        total = total + F.cross_entropy(out.logits[0, :-1].float(), d[1:], reduction="sum")
        count += d.numel() - 1
        logits.append(out.router_logits)
    gates = tuple(torch.cat([lg[layer] for lg in logits]) for layer in range(len(logits[0])))
    aux = lb(gates, ref.num_experts, ref.num_experts_per_tok, None)
    loss = total / count + ref.router_aux_loss_coef * aux
    loss.backward()
    return loss.item(), aux.item(), _grads(ref)


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[1, LENGTH - PAD:] = 0
    docs = [torch.randint(0, 256, (n,), generator=g) for n in DOCS]
    return ids, mask, docs


def _cp_run(model, cp, batch, dp_group, dp: int):
    model.zero_grad()
    out = model(**cp.shard_batch(batch))
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)  # over the whole world, as DDP does; each replica's share
        grads[n] = g / dp
    if dp > 1:  # the replicas' mean loss, as DDP's gradients are the mean
        dist.all_reduce(loss, group=dp_group)
        loss /= dp
    return loss.item(), out.aux_loss.item(), grads


def _errors(got, want) -> tuple[float, float, float]:
    (loss, aux, grads), (ref_loss, ref_aux, ref_grads) = got, want
    grad_err = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-6)).item() for n, g in ref_grads.items())
    return abs(loss - ref_loss) / abs(ref_loss), abs(aux - ref_aux) / abs(ref_aux), grad_err


def _mean(refs):
    loss = sum(r[0] for r in refs) / len(refs)
    grads = {n: sum(r[2][n] for r in refs) / len(refs) for n in refs[0][2]}
    return loss, refs, grads


def _rank(rank: int, world_size: int, cp_size: int, archs: tuple[str, ...]) -> list[tuple]:
    from transformers import DataCollatorWithFlattening

    import longdoc

    dp = world_size // cp_size
    cp_groups = [dist.new_group(list(range(r * cp_size, (r + 1) * cp_size))) for r in range(dp)]
    dp_groups = [dist.new_group(list(range(c, world_size, cp_size))) for c in range(cp_size)]
    replica = rank // cp_size
    cp = longdoc.ContextParallel(cp_groups[replica], timeout=60)
    results = []
    for arch in archs:
        ref, model = _pair(arch)
        longdoc.patch(model, cp)
        # every replica has its own batch; the reference is the replicas' mean, each computed in one process
        batches = [_batches(100 + r) for r in range(dp)]
        refs = [_padded_reference(ref, ids, mask) for ids, mask, _ in batches]
        ids, mask, docs = batches[replica]
        got = _cp_run(model, cp, {"input_ids": ids, "labels": ids, "attention_mask": mask}, dp_groups[rank % cp_size],
                      dp)
        loss, per, grads = _mean(refs)
        results.append((arch, "padded", *_errors(got, (loss, per[replica][1], grads))))
        refs = [_packed_reference(ref, d) for _, _, d in batches]
        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        batch = collate([{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs])
        batch = {k: v for k, v in batch.items() if not k.startswith("max_length")}
        got = _cp_run(model, cp, batch, dp_groups[rank % cp_size], dp)
        loss, per, grads = _mean(refs)
        results.append((arch, "packed", *_errors(got, (loss, per[replica][1], grads))))
    return results


def _check(per_rank) -> None:
    bad = [f"{a} {c}: loss {l:.1e} aux {x:.1e} grads {g:.1e}" for results in per_rank
           for a, c, l, x, g in results if not (l <= TOL and x <= TOL and g <= TOL)]
    assert not bad, "CP's MoE router loss differs from one process's:\n" + "\n".join(sorted(set(bad)))


def test_router_aux_loss_cp2():
    _check(run_ranks(2, _rank, 2, ARCHS + HYBRID_ARCHS, deadline=600, pg_timeout=60))


def test_router_aux_loss_dp2_cp2():
    _check(run_ranks(4, _rank, 2, ARCHS[:1], deadline=600, pg_timeout=60))


# ---- longdoc train: train.router_aux_loss_coef, the aux loss logged, cp=2 and dp=2 x cp=2 == one process ----

def _train_rank(rank: int, world_size: int, recipe: dict, overrides: list[str], pin: list | None = None):
    """(history, each step's gradients, the logged aux losses, the parameters after each step); pin: see
    tests/support/training.py train_pinned (the CP runs take each step's gradients at the one-process run's
    parameters)."""
    from tests.support.training import train_pinned

    hist, grads, params = train_pinned(rank, world_size, recipe, overrides, pin)
    import json
    from pathlib import Path

    logged = [json.loads(line) for line in (Path(recipe["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return hist, grads, [row.get("aux_loss") for row in logged if "loss" in row], params


def _recipe(tmp_path, name: str, coef: float) -> dict:
    from tests.support.training import tiny_recipe

    return tiny_recipe(tmp_path / name, model={"name": "tiny:mixtral", "overrides": {"vocab_size": 256}},
                       train={"router_aux_loss_coef": coef})


def _compare_train(tmp_path, runs) -> None:
    from tests.support.training import max_rel_err, ranks

    ref_hist, ref_grads, ref_aux, pin = ranks(1, _train_rank, _recipe(tmp_path, "single", 0.3), [], deadline=300)[0]
    assert all(a is not None and a > 0 for a in ref_aux)
    # the coefficient counts: at step 1 (same weights) the loss is the CE plus 0.3 x the logged aux loss
    ce_hist, _, ce_aux, _ = ranks(1, _train_rank, _recipe(tmp_path, "ce", 0.0), [], deadline=300)[0]
    assert ce_aux[0] is None
    assert abs(ref_hist[0][1] - (ce_hist[0][1] + 0.3 * ref_aux[0])) <= 1e-5 * ref_hist[0][1]
    for name, world in runs:
        for hist, grads, aux, _ in ranks(world, _train_rank, _recipe(tmp_path, name, 0.3), ["parallelism.cp_size=2"],
                                         pin, deadline=400):
            for (s, loss, tok, gn), (s0, loss0, tok0, gn0) in zip(hist, ref_hist, strict=True):
                assert (s, tok) == (s0, tok0)
                assert abs(loss - loss0) <= 1e-5 * abs(loss0) and abs(gn - gn0) <= 1e-5 * gn0, (name, s)
            for a, a0 in zip(aux, ref_aux, strict=True):
                assert abs(a - a0) <= 1e-5 * a0, (name, a, a0)
            for step_grads, step_ref in zip(grads, ref_grads, strict=True):
                assert max_rel_err(dict(enumerate(map(torch.as_tensor, step_grads))),
                                   dict(enumerate(map(torch.as_tensor, step_ref)))) <= 1e-5, name


def test_train_with_router_aux_loss_cp2_equals_single_process(tmp_path):
    _compare_train(tmp_path, [("cp2", 2)])


@pytest.mark.slow
def test_train_with_router_aux_loss_dp2_cp2_equals_single_process(tmp_path):
    _compare_train(tmp_path, [("dp2cp2", 4)])
