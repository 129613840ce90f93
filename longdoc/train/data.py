"""Training sequences and the deterministic order they are fed in.

The order is a pure function of (seed, optimizer step): sequence stream position p = step * batch_size
+ j lies in epoch p // n, at index perm(seed, epoch)[p % n]. So resuming needs only the step number,
any dp x cp layout sees the same sequences per optimizer step, and every rank of a CP group builds
the same full micro-batch without communicating (`cp.shard_batch` then keeps its part).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from longdoc.train.config import DataConfig, RecipeError

IGNORE = -100


@dataclass
class Sequences:
    """Token sequences for training: input_ids and unshifted labels (-100 = no loss), 1-D int64 each."""

    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    source: str

    def __len__(self) -> int:
        return len(self.input_ids)

    def fingerprint(self) -> dict:
        lengths = [int(x.numel()) for x in self.input_ids]
        checksum = sum(int(x[: 64].sum()) * (i + 1) for i, x in enumerate(self.input_ids)) % (1 << 61)
        return {"sequences": len(lengths), "tokens": sum(lengths), "checksum": checksum}


def random_sequences(n: int, seq_len: int, vocab_size: int, seed: int) -> Sequences:
    """Random tokens (benchmarks, memory tests, exactness tests): every token is a loss token."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab_size, (seq_len,), generator=g) for _ in range(n)]
    return Sequences(ids, [x.clone() for x in ids], f"random({n} x {seq_len}, vocab {vocab_size})")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RecipeError(f"data.path: {path}:{lineno} is not valid JSON ({e})") from e
    return rows


def _windows_from_tokens(rows: list[dict], seq_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ids, labels = [], []
    for row in rows:
        x = torch.as_tensor(row["input_ids"], dtype=torch.long)
        y = torch.as_tensor(row["labels"], dtype=torch.long) if "labels" in row else x.clone()
        if x.shape != y.shape:
            raise RecipeError(f"data: a record has {x.numel()} input_ids but {y.numel()} labels")
        for s in range(0, x.numel(), seq_len):  # longer records are cut into windows
            ids.append(x[s:s + seq_len])
            labels.append(y[s:s + seq_len])
    return ids, labels


def load_sequences(cfg: DataConfig, tokenizer, vocab_size: int, seed: int) -> Sequences:
    """Sequences from `cfg.path`: "random", a jsonl of tokenized windows, or documents to tokenize."""
    if cfg.path == "random":
        seqs = random_sequences(cfg.random_size, cfg.seq_len, vocab_size, seed)
    else:
        path = Path(cfg.path)
        if not path.exists():
            raise RecipeError(f"data.path: {path} does not exist; generate documents with `longdoc data synth "
                              f"--domain legal --out {path}` or point data.path at your jsonl/folder")
        seqs = _load_path(path, cfg, tokenizer)
    if cfg.max_sequences is not None:
        seqs = Sequences(seqs.input_ids[: cfg.max_sequences], seqs.labels[: cfg.max_sequences], seqs.source)
    keep = [i for i, y in enumerate(seqs.labels) if y.numel() >= 2 and bool((y[1:] != IGNORE).any())]
    if not keep:
        raise RecipeError(f"data: no training sequence with at least one loss token in {seqs.source} "
                          f"(empty file, or every label masked); check data.path and data.text_field")
    seqs = Sequences([seqs.input_ids[i] for i in keep], [seqs.labels[i] for i in keep], seqs.source)
    top = max(int(x.max()) for x in seqs.input_ids)
    low = min(int(x.min()) for x in seqs.input_ids)
    if low < 0 or top >= vocab_size:
        raise RecipeError(f"data: token ids span [{low}, {top}] but the model's vocabulary has {vocab_size} "
                          f"entries; the data was tokenized for another model (re-tokenize with this model's "
                          f"tokenizer)")
    return seqs


def _load_path(path: Path, cfg: DataConfig, tokenizer) -> Sequences:
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    rows = [r for f in files for r in _read_jsonl(f)]
    if not rows:
        raise RecipeError(f"data: {path} holds no records")
    if "input_ids" in rows[0]:
        ids, labels = _windows_from_tokens(rows, cfg.seq_len)
    else:
        ids, labels = _tokenize_documents(rows, cfg, tokenizer, str(path))
    return Sequences(ids, labels, str(path))


def _tokenize_documents(rows: list[dict], cfg: DataConfig, tokenizer, where: str):
    """Documents -> windows of cfg.seq_len tokens through the corpus layer (one implementation)."""
    if cfg.text_field not in rows[0]:
        raise RecipeError(f"data.text_field: records in {where} have no {cfg.text_field!r} field (fields: "
                          f"{sorted(rows[0])}); set data.text_field, or give pre-tokenized input_ids")
    from longdoc.train import corpus_bridge

    return corpus_bridge.windows(rows, cfg, tokenizer)


class StepSchedule:
    """Which sequences form optimizer step `step`, and how they split into micro-batches per replica."""

    def __init__(self, n: int, batch_size: int, micro_batch_size: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        self.n, self.batch_size, self.micro = n, batch_size, micro_batch_size
        self.dp_size, self.seed, self.shuffle = dp_size, seed, shuffle
        self.accum = batch_size // (micro_batch_size * dp_size)
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=g)
            else:
                self._perm = torch.arange(self.n)
            self._perm_epoch = epoch
        return self._perm

    def step_indices(self, step: int) -> list[int]:
        """Global sequence indices of optimizer step `step` (0-based), all replicas together."""
        out = []
        for p in range(step * self.batch_size, (step + 1) * self.batch_size):
            out.append(int(self._order(p // self.n)[p % self.n]))
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.n

    def micro_batches(self, step: int, dp_rank: int) -> list[list[int]]:
        """This replica's micro-batches (lists of sequence indices) for optimizer step `step`."""
        idx = self.step_indices(step)
        out = []
        for m in range(self.accum):
            start = (m * self.dp_size + dp_rank) * self.micro
            out.append(idx[start:start + self.micro])
        return out


def loss_tokens(seqs: Sequences, indices: Sequence[int]) -> int:
    """Number of tokens with a loss (after the causal shift) in these sequences."""
    return sum(int((seqs.labels[i][1:] != IGNORE).sum()) for i in indices)


def collate(seqs: Sequences, indices: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) micro-batch: right-padded input_ids and unshifted labels, (batch, max_len)."""
    length = max(seqs.input_ids[i].numel() for i in indices)
    ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), length), IGNORE, dtype=torch.long)
    for row, i in enumerate(indices):
        n = seqs.input_ids[i].numel()
        ids[row, :n] = seqs.input_ids[i]
        labels[row, :n] = seqs.labels[i]
    return {"input_ids": ids, "labels": labels}
