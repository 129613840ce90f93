"""Validation loss on held-out rows under CP, early stopping on a plateau, and the extra Accelerate trackers.

    longdoc train recipes/cpu-demo.yaml eval.every=5 eval.holdout=4 eval.patience=3 log.trackers=auto

The validation loss is the token-mean cross-entropy over ALL held-out rows: each data-parallel replica takes
rows r, r + dp, ..., every CP rank of its group shards them with cp.shard_batch, each rank's share is its
tokens' loss / the held-out set's loss-token count, and the shares are summed over the world. So it is the
number one process computes on the same rows, for any dp x cp layout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import torch
import torch.distributed as dist

from longdoc.parallel.batch import ROW_LENGTHS
from longdoc.train.config import EvalConfig, LogConfig, Recipe, RecipeError
from longdoc.train.data import Sequences, collate, document_keys, load_sequences, loss_tokens
from longdoc.train.data import passes as data_passes

OPTIONAL_TRACKERS = ("wandb", "mlflow", "trackio")


def split_held_out(recipe: Recipe, seqs: Sequences, tokenizer, vocab_size: int,
                   main_first=None) -> tuple[Sequences, Sequences | None]:
    """(training rows, held-out rows or None) for the recipe's `eval` section."""
    ev = recipe.eval
    if not (ev.path or ev.holdout):
        return seqs, None
    if ev.path:
        cfg = dataclasses.replace(recipe.data, path=ev.path, shuffle=False, max_sequences=ev.max_sequences, mix=[])
        return seqs, load_sequences(cfg, tokenizer, vocab_size, recipe.seed, main_first=main_first)
    n = len(seqs)
    docs, passes = document_keys(seqs), data_passes(seqs)
    first = [i for i in range(n) if passes is None or passes[i] == 0]  # one pass over the documents
    if ev.holdout >= len(first):
        raise RecipeError(f"eval.holdout={ev.holdout} would leave no training rows ({len(first)} rows in "
                          f"{seqs.source}); hold out fewer or set eval.path to separate held-out data")
    held_rows = first[len(first) - ev.holdout:]
    if docs is None:
        train_rows = [i for i in range(n) if i not in set(held_rows)]
    else:
        # Hold out whole documents: another window or another pass of a held-out document (the same
        # facts, the same questions in another order) must never be trained on.
        held_docs = frozenset().union(*(docs[i] for i in held_rows))
        train_rows = [i for i in range(n) if not docs[i] & held_docs]
        if not train_rows:
            raise RecipeError(f"eval.holdout={ev.holdout}: the held-out rows' documents are every document in "
                              f"{seqs.source}; hold out fewer or set eval.path to separate held-out data")
    train = Sequences(seqs.ds.select(train_rows), seqs.source)
    train.scan(vocab_size)  # its own fingerprint: resume checks compare the rows actually trained on
    keep = ev.holdout if ev.max_sequences is None else min(ev.holdout, ev.max_sequences)
    held = Sequences(seqs.ds.select(held_rows[:keep]), f"{seqs.source} (held out)")
    return train, held


def due(ev: EvalConfig, step: int, is_last: bool) -> bool:
    return bool((ev.every and step % ev.every == 0) or (is_last and ev.at_end))


@torch.no_grad()
def validation_loss(loss_model, world, seqs: Sequences, micro_batch_size: int, pad_id: int) -> float:
    """Token-mean loss over every held-out row, computed under CP (identical on every rank)."""
    n = len(seqs)
    mine = list(range(world.dp_rank, n, world.dp_size))
    per_replica = -(-n // world.dp_size)
    # The same number of forwards on every replica: FSDP gathers parameters inside each one. A replica
    # with fewer rows reruns row 0 with weight 0.
    rounds = -(-per_replica // micro_batch_size)
    total = loss_tokens(seqs, range(n))
    was_training = loss_model.training
    loss_model.eval()  # no LoRA / attention dropout
    acc = torch.zeros((), dtype=torch.float64)
    try:
        for r in range(rounds):
            idx = mine[r * micro_batch_size:(r + 1) * micro_batch_size]
            weight = 1.0 if idx else 0.0
            local = world.cp.shard_batch(collate(seqs, idx or [0], pad_id), pad_token_id=pad_id)
            cu = local.get("cu_seq_lens_q")  # packed rows: the documents, as in training
            lengths = local.get(ROW_LENGTHS)  # padded rows: their real lengths (CE only: no router aux loss)
            share, _ = loss_model(local["input_ids"].to(world.device), local["position_ids"].to(world.device),
                                  local["shift_labels"].to(world.device), total,
                                  cu_seq_lens=cu.to(world.device) if cu is not None else None,
                                  row_lengths=lengths.to(world.device) if lengths is not None else None)
            acc += share.detach().double().cpu() * weight
    finally:
        loss_model.train(was_training)
    (total_loss,) = world.all_reduce([float(acc)], dist.ReduceOp.SUM, "validation loss")  # the scalars group
    return total_loss


class EarlyStopping:
    """Stop after `patience` validations in a row without a loss below best - min_delta."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0

    def update(self, loss: float, step: int) -> bool:
        """Record a validation loss; True when training should stop."""
        if self.best is None or loss < self.best - self.min_delta:
            self.best, self.best_step, self.bad = loss, step, 0
        else:
            self.bad += 1
        return self.patience > 0 and self.bad >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.best, self.best_step, self.bad = state.get("best"), int(state.get("best_step", 0)), int(state["bad"])


def extra_trackers(log: LogConfig, output_dir: str | Path) -> tuple[list[str], dict]:
    """(Accelerate tracker names, init_kwargs) for `log.trackers`, set up to run offline.

    Offline unless the user already chose: wandb writes OUTPUT/wandb (WANDB_MODE=offline; `wandb sync` uploads
    later), mlflow a file store OUTPUT/mlruns, trackio its local store under OUTPUT/trackio.
    """
    wanted = list(OPTIONAL_TRACKERS) if "auto" in log.trackers else list(dict.fromkeys(log.trackers))
    installed = [t for t in wanted if importlib.util.find_spec(t) is not None]
    missing = [t for t in wanted if t not in installed]
    if missing and "auto" not in log.trackers:
        raise RecipeError(f"log.trackers: {missing} not installed; `pip install {' '.join(missing)}`, or drop them "
                          f"(log.trackers=auto uses whichever of {', '.join(OPTIONAL_TRACKERS)} is installed)")
    out = Path(output_dir).resolve()
    kwargs: dict = {}
    if "wandb" in installed:
        os.environ.setdefault("WANDB_MODE", "offline")
        kwargs["wandb"] = {"dir": str(out), "name": out.name}
    if "mlflow" in installed:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (out / "mlruns").as_uri())
    if "trackio" in installed:
        os.environ.setdefault("TRACKIO_DIR", str(out / "trackio"))
    return installed, kwargs
