"""A survey of every causal-LM type in the installed transformers under CP: exact, refused by name, or wrong.

    python -m tests.survey                      # every type, CP=2, writes docs/models/survey.json
    python -m tests.survey --types llama,mamba2 --cp 3 --out /tmp/s.json

Each type gets a tiny random-init config (the tests' hand-made family configs where they exist, else a generic
shrink of transformers' default config), a float64 single-process reference (HF's own forward, eager attention,
its own loss) and a patched twin run on `cp` gloo ranks from `cp.shard_batch`. Statuses:
  exact     loss and every gradient equal the reference (relative 1e-5; real differences are orders larger);
            a gradient numerically zero (below 1e-4 of the model's largest entry in float64, such as OPT's key
            bias: softmax ignores a per-row constant, so both runs hold rounding left from large terms) is
            compared to that floor; a type whose training forward samples at random (it differs from itself
            under another seed, as PhiMoE's sparsemixer) is compared in eval mode and says so;
  refused   longdoc refused it by name (UnsupportedFeatureError / CPInputError) before computing anything;
  unbuilt   no tiny model could be built from the config (not a longdoc result: listed for completeness);
  WRONG     a result that differs from the reference: the one unacceptable outcome;
  CRASH     any other exception (a traceback a user would see).
Every type runs in a fresh process group, so one type's failure cannot desynchronise the next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

TOL = 1e-5  # relative; the CP core merges softmax blocks in fp32 (DESIGN.md), so float64 runs agree to ~1e-7
TOL_FP32 = 1e-4  # where a kernel has no float64 (the tests' fp32 gradient tolerance)
ZERO_FP64, ZERO_FP32 = 1e-4, 1e-2  # below this x the largest gradient entry, a gradient is numerically 0
LENGTH = 40
MAX_PARAMS = 20_000_000  # longer than the families' windows / chunks / index_topk, not a multiple of 2*cp
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
              initializer_range=0.1, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=64, sliding_window=7, index_topk=8,
              attention_chunk_size=7, tie_word_embeddings=False)


def _hand_made(model_type: str):
    """The tests' own config for a family, where one exists (hand-checked shapes and patterns)."""
    import importlib

    for module, getter in (("tests.hf_families", "family_config"), ("tests.hf_hybrids", "hybrid_config"),
                           ("tests.hf_hybrids_linear", "hybrid_config"), ("tests.hf_dsa", "dsa_config")):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        families = getattr(mod, "FAMILIES", None) or getattr(mod, "HYBRIDS", None) or {}
        if model_type in families and hasattr(mod, getter):
            return getattr(mod, getter)(model_type)
    return None


def tiny_config(model_type: str):
    """A tiny config of `model_type`: the tests' own, else transformers' default shrunk (may raise)."""
    from transformers import AutoConfig

    config = _hand_made(model_type)
    if config is not None:
        return config
    default = AutoConfig.for_model(model_type)
    text = default.get_text_config()
    overrides = {k: v for k, v in _SMALL.items() if hasattr(text, k)}
    types = getattr(text, "layer_types", None)
    if types:  # keep one layer of every type, in order of first appearance
        kinds = list(dict.fromkeys(types))
        overrides["layer_types"] = kinds
        overrides["num_hidden_layers"] = len(kinds)
    def make(over):
        if text is default:
            return AutoConfig.for_model(model_type, **over)
        return AutoConfig.for_model(model_type, text_config=over)  # composite (multimodal) configs

    try:
        config = make(overrides)
    except (AttributeError, TypeError, ValueError):  # e.g. layer_types derived from other fields
        overrides.pop("layer_types", None)
        overrides.pop("num_hidden_layers", None)
        config = make(overrides)
    text = config.get_text_config()
    for key, value in vars(text).items():
        if "drop" in key and isinstance(value, float):  # dropout, pdrop, *_dropout_prob, layerdrop
            setattr(text, key, 0.0)
    vocab = getattr(text, "vocab_size", 256)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(text, key, None)
        if isinstance(v, int) and v >= vocab:
            setattr(text, key, vocab - 1)
    return config


def _build(model_type: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    with torch.device("meta"):  # a default left large by the shrink would take gigabytes: refuse it first
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {size / 1e6:.0f}M parameters (over {MAX_PARAMS / 1e6:.0f}M)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for extra in ({"attn_implementation": "eager", "experts_implementation": "eager"},
                      {"attn_implementation": "eager"}, {}):
            try:
                model = AutoModelForCausalLM.from_config(config, **extra)
                break
            except (ValueError, TypeError):
                continue
        else:
            model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _exact_kernels(model_type: str):
    """A family module's `exact_kernels(model_type)` context (nothing elsewhere): kernels that compute in fp32
    whatever the model's dtype (the delta rule's chunk kernels) swapped for their float64 definition, in the
    reference and in the CP run alike, so that the float64 pass compares CP with one process and not two
    fp32 roundings of one kernel (whose decay-gate gradients move 1e-4 with the kernel's own chunk size)."""
    import contextlib
    import importlib

    for module in ("tests.hf_hybrids_linear",):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, "exact_kernels"):
            return mod.exact_kernels(model_type)
    return contextlib.nullcontext()


def _one(model_type: str, cp) -> tuple[str, str]:
    """(status, detail) of one type on this rank."""
    with _exact_kernels(model_type):
        return _compare(model_type, cp)


def _reference(model, ids, seed: int):
    """(loss, {name: grad}) of one single-process forward and backward, the model's random draws seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _worst(loss, grads: dict, ref_loss, ref_grads: dict, floor: float) -> tuple[float, str]:
    """The largest relative difference (loss, then every gradient) and where. A gradient is relative to its own
    largest entry, floored at `floor` x the model's largest gradient entry: a gradient that is zero in exact
    arithmetic (OPT's key bias: softmax ignores a per-row constant) is rounding noise in both runs, and its
    relative error would be noise over noise."""
    scale = max((g.abs().max().item() for g in ref_grads.values() if g.numel()), default=0.0)
    worst, where = abs(loss - ref_loss).item() / max(abs(ref_loss.item()), 1e-12), "loss"
    for name in sorted(set(grads) | set(ref_grads)):
        g = grads.get(name)
        want = ref_grads.get(name)
        g = torch.zeros_like(want) if g is None else g
        want = torch.zeros_like(g) if want is None else want
        if not g.numel():
            continue
        err = ((g - want).abs().max() / max(want.abs().max().item(), floor * scale, 1e-300)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def _compare(model_type: str, cp) -> tuple[str, str]:
    import copy

    import torch.distributed as dist

    import longdoc
    from longdoc.hf import CPInputError, UnsupportedFeatureError

    problem = None
    for dtype in (torch.float64, torch.float32):  # some kernels have no float64
        tol = TOL if dtype == torch.float64 else TOL_FP32
        floor = ZERO_FP64 if dtype == torch.float64 else ZERO_FP32
        try:
            ref = _build(model_type, dtype)
            vocab = ref.get_input_embeddings().num_embeddings
        except Exception as e:  # noqa: BLE001 - any failure to build is "unbuilt", reported with its reason
            return "unbuilt", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        twin = copy.deepcopy(ref)
        ids = torch.randint(0, vocab, (2, LENGTH), generator=torch.Generator().manual_seed(1))
        try:
            ref_loss, ref_grads = _reference(ref, ids, seed=0)
            problem = None
            break
        except Exception as e:  # noqa: BLE001 - the reference itself does not run: nothing to compare
            problem = f"reference forward failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if problem is not None:
        return "unbuilt", problem
    # A training forward that draws random numbers (PhiMoE's sparsemixer samples its experts; LayerDrop) differs
    # from itself under another seed: no run, sharded or not, can equal it. Such a type is compared in eval mode
    # (no sampling, gradients still flow) and says so; under CP each rank draws for its own tokens, as dropout.
    mode = ""
    again_loss, again_grads = _reference(ref, ids, seed=1)
    if _worst(again_loss, again_grads, ref_loss, ref_grads, floor)[0] > tol:
        ref.eval()
        twin.eval()
        ref_loss, ref_grads = _reference(ref, ids, seed=0)
        mode = ", eval mode: its training forward samples at random"
    try:
        model = longdoc.patch(twin, cp)
        out = model(**cp.shard_batch({"input_ids": ids, "labels": ids}))
        out.loss.backward()
    except (UnsupportedFeatureError, CPInputError) as e:
        return "refused", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001
        return "CRASH", traceback.format_exc(limit=4)[-600:] if not str(e) else f"{type(e).__name__}: {e}"[:600]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=cp.group)
    grads = {}
    for name, p in twin.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=cp.group)
        grads[name] = g
    worst, where = _worst(loss, grads, ref_loss, ref_grads, floor)
    if worst <= tol:
        return "exact", f"max relative error {worst:.1e} ({str(dtype).removeprefix('torch.')}{mode})"
    return "WRONG", f"relative error {worst:.2e} in {where}{mode}"


def _rank(rank: int, world: int, types: list[str]) -> dict[str, tuple[str, str]]:
    import torch.distributed as dist
    from transformers.utils import logging

    import longdoc

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    results = {}
    for t in types:
        if rank == 0:
            print(f"survey: {t}", file=sys.stderr, flush=True)  # where it was, if a type takes the process down
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
        cp = longdoc.ContextParallel(group, timeout=60)
        try:
            results[t] = _one(t, cp)
        except Exception as e:  # noqa: BLE001 - a failure inside the comparison itself
            results[t] = ("CRASH", f"{type(e).__name__}: {e}"[:600])
        statuses = [None] * world
        dist.all_gather_object(statuses, results[t])
        if len({s[0] for s in statuses}) > 1:  # ranks disagree: the worst status wins, with every rank's view
            worst = next(s for s in ("WRONG", "CRASH", "refused", "unbuilt", "exact") if s in {x[0] for x in statuses})
            results[t] = (worst, " | ".join(f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(statuses)))
        dist.destroy_process_group(group)
    return results


def survey(types: list[str] | None = None, cp: int = 2, deadline: float = 7200) -> dict[str, tuple[str, str]]:
    """{model_type: (status, detail)} for the given types (default: every causal-LM type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from longdoc.spawn import run_local

    types = sorted(types or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return run_local(cp, _rank, types, deadline=deadline, pg_timeout=120)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--out", default="docs/models/survey.json")
    args = parser.parse_args()
    import transformers

    results = survey(args.types.split(",") if args.types else None, args.cp)
    counts: dict[str, int] = {}
    for status, _ in results.values():
        counts[status] = counts.get(status, 0) + 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"transformers": transformers.__version__, "torch": torch.__version__, "cp": args.cp,
              "counts": counts, "types": {t: {"status": s, "detail": d} for t, (s, d) in results.items()}}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(out)
    for t, (s, d) in sorted(results.items()):
        if s in ("WRONG", "CRASH"):
            print(f"{s:8s} {t}: {d}")
    print(f"{len(results)} types at cp={args.cp}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
