"""Shared pieces of the distributed training tests: a tiny recipe, the launcher variables Accelerate reads,
run_ranks with a generous timeout, and rank functions more than one test module runs.

Rank functions live in a plain module (not a test module, not a fixture) because longdoc.runtime.spawn pickles
them by module and name into fresh processes.
"""

from __future__ import annotations

from longdoc.runtime.launch import set_launcher_env
from tests.support.distributed import run_ranks


def ranks(world_size: int, fn, *args, **kwargs):
    """run_ranks with a generous collective timeout: on a loaded 2-core machine one rank can lag the other
    by more than the 30 s default (the loop's own collectives use train.comm_timeout in real runs)."""
    kwargs.setdefault("pg_timeout", 300)
    return run_ranks(world_size, fn, *args, **kwargs)


def accelerate_env(rank: int, world_size: int) -> None:
    """run_ranks has already joined the gloo group; Accelerate reads the launcher's variables. Every training
    test runs with the collective guard on (longdoc.parallel.guard): a collective issued out of order fails
    there by name instead of crashing in gloo or passing silently."""
    set_launcher_env(rank, world_size, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", LONGDOC_DEBUG_COLLECTIVES="1")


def tiny_recipe(out, **sections) -> dict:
    r = {
        "output_dir": str(out),
        "model": {"name": "tiny:llama", "overrides": {"vocab_size": 256}},
        "data": {"path": "random", "seq_len": 96, "random_size": 12},
        # eps 1e-6 rather than 1e-8: Adam turns a gradient element of ~1e-10 into a full +-lr step, so
        # float rounding in such an element (any change of summation order does it) would show as a
        # 1e-4 parameter difference that says nothing about CP. Gradient norms are compared exactly too.
        "optim": {"lr": 1e-3, "eps": 1e-6, "warmup_steps": 1, "max_grad_norm": 1.0, "weight_decay": 0.01},
        # fp32: these runs are compared with one process at 1e-5 (bf16 has its own tests and tolerances)
        "train": {"steps": 3, "batch_size": 2, "loss_chunk_tokens": 16, "mixed_precision": "no"},
        "checkpoint": {"every": 0, "at_end": False, "export": True},
        "log": {"progress": False, "tensorboard": False, "plot": False},
    }
    for k, v in sections.items():
        r.setdefault(k, {}).update(v) if isinstance(v, dict) else r.__setitem__(k, v)
    return r


def train_with_nan_at(rank: int, world_size: int, recipe: dict, overrides: list[str], bad_step: int):
    """Make the loss NaN on rank 0 only at optimizer step `bad_step` (1-based); return history and weights."""
    accelerate_env(rank, world_size)
    import torch

    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train
    from longdoc.train.loss import LossModel

    forward, calls = LossModel.forward, {"n": 0}

    def poisoned(self, *args, **kwargs):
        share, ce = forward(self, *args, **kwargs)
        if kwargs.get("probe"):
            return share, ce  # the start-up logits check, not a training step
        calls["n"] += 1
        if calls["n"] == bad_step and rank == 0:
            share = share * torch.tensor(float("nan"))
        return share, ce

    LossModel.forward = poisoned
    snapshots = []

    def on_step(info):
        snapshots.append(float(sum(p.detach().double().sum() for p in info.world.accelerator._models[0].parameters())))

    try:
        hist = train(recipe_from_dict(recipe, overrides), on_step=on_step).history
    except FloatingPointError as e:
        return ("aborted", str(e))
    return [(s.step, s.skipped) for s in hist], snapshots


def train_on_ranks(rank: int, world_size: int, recipe: dict, overrides: list[str]):
    """(history, the reduced gradients each optimizer step applied)."""
    return train_pinned(rank, world_size, recipe, overrides)[:2]


def train_pinned(rank: int, world_size: int, recipe: dict, overrides: list[str], pin: list | None = None):
    """Train; (history, the reduced gradients each step applied, the trained parameters after each step).

    pin: another run's parameters after each step (its third result). After step k < len(pin) this run's trained
    parameters are set to pin[k - 1], so its step k + 1 gradients are taken at the other run's parameters: runs
    compared step by step then differ only by what each step computes, never by rounding that Adam amplified in
    the steps before (an element whose gradient is ~0 moves by a full +-lr whose sign follows that rounding). The
    last step is not pinned: the final weights still differ by one step of each run's own."""
    accelerate_env(rank, world_size)
    import torch

    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    grads: list[list] = []  # numpy copies: tensors would go back through shared memory of a dead process
    params: list[list] = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):  # the reduced gradients the optimizer is about to apply
        trained = [p for g in self.param_groups for p in g["params"]]
        grads.append([_full(p.grad).detach().numpy().copy() for p in trained])
        out = step(self, *args, **kwargs)
        if pin is not None and len(grads) < len(pin):
            with torch.no_grad():
                for p, w in zip(trained, pin[len(grads) - 1], strict=True):
                    _load(p, torch.from_numpy(w))
        params.append([_full(p).detach().numpy().copy() for p in trained])
        return out

    torch.optim.AdamW.step = recording_step
    result = train(recipe_from_dict(recipe, overrides))
    return [(s.step, s.loss, s.tokens, s.grad_norm) for s in result.history], grads, params


def assert_steps_equal(ref: list, ref_grads: list, runs: list, label: str, rel: float = 1e-5) -> None:
    """Every rank of `runs` (train_pinned results) took the steps of the reference run (train_pinned's first two
    results): per step the same step number and loss-token count, the loss and grad norm within `rel`, and the
    reduced gradient of every trained tensor within `rel` of that tensor's largest reference element."""
    import pytest

    for rank_hist, rank_grads, *_ in runs:
        for step, (step_grads, step_ref) in enumerate(zip(rank_grads, ref_grads, strict=True), 1):
            errs = [float(abs(g - r).max() / max(abs(r).max(), 1e-30)) for g, r in zip(step_grads, step_ref,
                                                                                     strict=True)]
            worst = max(range(len(errs)), key=errs.__getitem__)
            assert errs[worst] <= rel, (label, f"step {step}", f"tensor {worst} of {len(errs)}",
                                        tuple(step_ref[worst].shape), errs[worst], float(abs(step_ref[worst]).max()))
        assert len(rank_hist) == len(ref), (label, rank_hist, ref)
        for (s, loss, tok, gn), (s0, loss0, tok0, gn0) in zip(rank_hist, ref, strict=True):
            assert (s, tok) == (s0, tok0), label
            assert loss == pytest.approx(loss0, rel=rel, abs=1e-6), (label, s, loss, loss0)
            assert gn == pytest.approx(gn0, rel=rel), (label, s, gn, gn0)


def _load(p, full) -> None:
    """Set parameter p (a plain tensor, or FSDP2's sharded DTensor) to the full tensor `full`."""
    if hasattr(p, "full_tensor"):
        from torch.distributed.tensor import distribute_tensor

        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    else:
        p.copy_(full)


def _full(t):
    """A gradient as one tensor: FSDP2's are sharded DTensors (gathered: a collective every rank runs alike)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)


def train_cases(rank: int, world_size: int, recipes: dict[str, dict], overrides: list[str]) -> dict[str, dict]:
    """Train every recipe in turn in this process; per recipe the (step, loss, tokens, grad_norm) history and
    how many collectives the debug guard checked on each group (0 on one process)."""
    accelerate_env(rank, world_size)
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    # Accelerator.end_training destroys the process group; the next recipe needs it (run_ranks tears it down)
    PartialState.destroy_process_group = lambda self, group=None: None
    out = {}
    for name, recipe in recipes.items():
        AcceleratorState._reset_state()  # each recipe its own Accelerator (mixed precision may differ)
        GradientState._reset_state()
        seen = {}

        def on_step(info, seen=seen):
            w, groups = info.world, getattr(info.world, "groups", None)  # getattr: also runs on older code
            guards = {"cp": getattr(w.cp, "guard", None), "grads": groups.guard("grads") if groups else None,
                      "scalars": groups.guard("scalars") if groups else None}
            seen.update({k: g.seq if g is not None else 0 for k, g in guards.items()})

        result = train(recipe_from_dict(recipe, overrides), on_step=on_step)
        out[name] = {"history": [(s.step, s.loss, s.tokens, s.grad_norm) for s in result.history], "guard": seen}
    return out
