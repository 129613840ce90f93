"""Training mixes (`data.mix`): rows from several sources, each with its share of the rows and its token weights.

    data:
      seq_len: 8192
      mix:
        - {source: qa, path: runs/data/legal-qa-train.jsonl, weight: 0.75, document_loss_weight: 0.1}
        - {source: documents, path: runs/data/legal-qa-train.jsonl, weight: 0.25}   # LM loss on the documents
        - {source: text, path: my_corpus/, weight: 0.1, pack: true}                # replay: your own text
        - {source: rehearsal, weight: 0.1, pack: true}     # replay: text the base model generated itself

The order stays a pure function of (seed, optimizer step), as for one source (longdoc.train.data): stream
position p draws from source s(p), chosen by smooth weighted round-robin (after p positions every source has
had its share of them, to within one row), and the k-th draw from source s is row perm_s(seed, k // n_s)[k % n_s]
of that source. Resuming needs only the step number; every CP rank builds the same batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from longdoc.train.config import DataConfig, MixSource, RecipeError
from longdoc.train.data import Sequences, StepSchedule, TokenWeights, load_sequences


class MixedSequences:
    """Several sources' rows behind one index: rows [offsets[s], offsets[s + 1]) belong to source s."""

    def __init__(self, parts: list[Sequences], names: list[str]):
        self.parts, self.names = parts, names
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + len(p))
        self.source = " + ".join(f"{n}: {p.source}" for n, p in zip(names, parts))
        self.weighted = any(p.weighted for p in parts)

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, i: int) -> tuple[Sequences, int]:
        i = int(i)
        for s, p in enumerate(self.parts):
            if i < self.offsets[s + 1]:
                return p, i - self.offsets[s]
        raise IndexError(f"row {i} of a mix of {len(self)} rows")

    def row(self, i: int):
        p, j = self.locate(i)
        return p.row(j)

    def targets(self, i: int, step: int | None = None):
        p, j = self.locate(i)
        return p.targets(j, step)

    def position_ids(self, i: int):
        p, j = self.locate(i)
        return p.position_ids(j)

    def loss_targets(self, i: int):
        p, j = self.locate(i)
        return p.loss_targets(j)

    def fingerprint(self) -> dict:
        return {"mix": [{"source": n, **p.fingerprint()} for n, p in zip(self.names, self.parts)]}


class MixSchedule(StepSchedule):
    """StepSchedule over a MixedSequences: which rows form each optimizer step (module docstring)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, micro_batch_size: int,
                 dp_size: int, seed: int, shuffle: bool = True):
        super().__init__(sum(sizes), batch_size, micro_batch_size, dp_size, seed, shuffle)
        total = float(sum(weights))
        self.sizes, self.shares = list(sizes), [w / total for w in weights]
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self._draws: list[tuple[int, int]] = []  # position p -> (source, its k-th draw)
        self._credit = [0.0] * len(sizes)
        self._count = [0] * len(sizes)
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def _draw(self, p: int) -> tuple[int, int]:
        while len(self._draws) <= p:  # smooth weighted round-robin: exact shares, evenly interleaved
            for s, share in enumerate(self.shares):
                self._credit[s] += share
            s = max(range(len(self.shares)), key=lambda j: (self._credit[j], -j))
            self._credit[s] -= 1.0
            self._draws.append((s, self._count[s]))
            self._count[s] += 1
        return self._draws[p]

    def _source_order(self, s: int, epoch: int) -> torch.Tensor:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            n = self.sizes[s]
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 7919 * s)
                self._perms[key] = torch.randperm(n, generator=g)
            else:
                self._perms[key] = torch.arange(n)
        return self._perms[key]

    def step_indices(self, step: int) -> list[int]:
        out = []
        for p in range(step * self.batch_size, (step + 1) * self.batch_size):
            s, k = self._draw(p)
            n = self.sizes[s]
            out.append(self.offsets[s] + int(self._source_order(s, k // n)[k % n]))
        return out

    def source_counts(self, steps: int) -> list[int]:
        """Rows each source gives over the first `steps` optimizer steps."""
        counts = [0] * len(self.sizes)
        for p in range(steps * self.batch_size):
            counts[self._draw(p)[0]] += 1
        return counts


def _source_config(data: DataConfig, src: MixSource, path: str) -> DataConfig:
    return dataclasses.replace(data, path=path, task=src.task, text_field=src.text_field,
                               max_sequences=src.max_sequences, questions_per_row=src.questions_per_row,
                               pack=src.pack, mix=[])


def rows_per_source(mix: list[MixSource], rows: int) -> list[int]:
    """Rows each source gives over a run of `rows` rows (its share, rounded up)."""
    total = sum(m.weight for m in mix)
    return [math.ceil(rows * m.weight / total) for m in mix]


def load_mix(data: DataConfig, tokenizer, vocab_size: int, seed: int, main_first=None, rows_needed: int | None = None,
             model_name: str | None = None) -> MixedSequences:
    """Every source of `data.mix` loaded as training rows with its token weights."""
    parts, names = [], []
    wanted = rows_per_source(data.mix, rows_needed) if rows_needed else [None] * len(data.mix)
    for i, (src, need) in enumerate(zip(data.mix, wanted)):
        path = src.path
        if src.source == "rehearsal":
            from longdoc.corpus import rehearsal

            path = str(rehearsal.ensure(model_name, tokenizer, samples=src.samples, max_new_tokens=src.max_new_tokens,
                                        seed=src.seed, path=src.path or None, main_first=main_first))
        try:
            seqs = load_sequences(_source_config(data, src, path), tokenizer, vocab_size, seed, main_first=main_first,
                                  rows_needed=need)
        except RecipeError as e:
            raise RecipeError(f"data.mix[{i}] ({src.source}): {e}") from None
        weights = TokenWeights(loss=src.loss_weight, document=src.document_loss_weight, kl=src.kl_weight,
                               context_positions=src.context_positions)
        parts.append(Sequences(seqs.ds, seqs.source, weights, draw_key=(seed, i)))
        parts[-1].scan(vocab_size)
        names.append(src.source)
    return MixedSequences(parts, names)


def describe(mixed: MixedSequences, schedule: MixSchedule, steps: int) -> str:
    counts = schedule.source_counts(steps)
    return ", ".join(f"{n} {len(p)} rows ({c} drawn)" for n, p, c in zip(mixed.names, mixed.parts, counts))
