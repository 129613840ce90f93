"""Training sequences and the deterministic order they are fed in.

The order is a pure function of (seed, optimizer step): sequence stream position p = step * batch_size
+ j lies in epoch p // n, at index perm(seed, epoch)[p % n]. So resuming needs only the step number,
any dp x cp layout sees the same sequences per optimizer step, and every rank of a CP group builds
the same full micro-batch without communicating (`cp.shard_batch` then keeps its part).

Packed rows (`longdoc data prepare --pack`: several documents per row, position_ids restarting at 0 at
each document) train exactly: the micro-batch carries their position_ids, cp.shard_batch lays each
document out on its own and the attention never crosses a document, and a document's last token
predicts nothing (`loss_tokens` counts the same targets).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from longdoc.train.config import DataConfig, RecipeError
from longdoc.train.weights import TokenWeights, draw_context, shard_target_weights  # noqa: F401 - re-exported

IGNORE = -100


class Sequences:
    """Training rows: input_ids and unshifted labels (-100 = no loss), read lazily from a `datasets.Dataset`
    (memory-mapped Arrow: a corpus of 128k-token rows is not copied into every rank's Python heap).

    `weights` (TokenWeights) turn a source's rows into weighted ones: `targets(i)` then gives per-token loss
    and KL weights beside the labels, aligned with them (weight[t] counts the prediction of token t).
    `draw_key` (the recipe seed and the source's place in a mix) keys the context positions drawn per row
    and step (weights.context_positions)."""

    def __init__(self, ds, source: str, weights: TokenWeights | None = None, draw_key: tuple[int, ...] = ()):
        self.has_positions = "position_ids" in ds.column_names
        self.weights = weights or TokenWeights()
        self.draw_key = tuple(draw_key)
        self.has_doc_span = "doc_span" in ds.column_names
        # preference rows (data.task: preference): [prompt | chosen | rejected] per pair, longdoc.corpus.preference
        self.has_branches = "branches" in ds.column_names
        if (self.weights.document or self.weights.kl) and not self.has_doc_span and _is_qa(ds):
            raise RecipeError(f"data.mix: {source} holds QA rows without doc_span (prepared by an older longdoc), "
                              f"so document_loss_weight / kl_weight cannot find the document; prepare them again or "
                              f"give the raw documents")
        columns = ["input_ids", "labels"] + (["position_ids"] if self.has_positions else []) \
            + (["doc_span"] if self.has_doc_span else []) + (["branches"] if self.has_branches else [])
        self.ds = ds.with_format("torch", columns=columns)
        self.source = source
        self._fingerprint: dict | None = None

    def __len__(self) -> int:
        return len(self.ds)

    @property
    def weighted(self) -> bool:
        """Rows whose targets carry weights other than 1 (the loss is then sum(w * CE) / sum(w))."""
        return not self.weights.plain

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels); with a document loss weight the document tokens of QA rows are labels too."""
        r = self.ds[int(i)]
        ids, labels = r["input_ids"].long(), r["labels"].long()
        if self.weights.document and self.has_doc_span:
            a, b = (int(x) for x in r["doc_span"])
            labels = labels.clone()
            labels[a:b] = ids[a:b]
        return ids, labels

    def targets(self, i: int, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(labels, loss weights, KL weights) of row i, each (len,), aligned with the unshifted labels.

        With `step` (the optimizer step) and weights.context_positions, the document loss and the KL count at
        the context positions drawn for (draw_key, i, step) only, scaled up to stand for the rest
        (`draw_context`); the others get label IGNORE (document loss) and weights 0. The row's own targets
        always count. Without `step` (the step's denominators, validation): every context token."""
        r = self.ds[int(i)]
        ids, own = r["input_ids"].long(), r["labels"].long()
        labels = own.clone()
        w = torch.where(own != IGNORE, self.weights.loss, 0.0).double()
        kl = torch.zeros_like(w)
        context = torch.zeros_like(own, dtype=torch.bool)
        if self.has_doc_span:  # QA rows: the context tokens are the document
            a, b = (int(x) for x in r["doc_span"])
            context[a:b] = True
            if self.weights.document:
                labels[a:b] = ids[a:b]
                w[a:b] = self.weights.document
            kl[a:b] = self.weights.kl
        elif self.weights.kl:
            context = own != IGNORE
            kl = torch.where(context, self.weights.kl, 0.0).double()
        if step is not None and self.weights.context_positions:
            # the positions step_denominators counts: never the first token, nor a packed document's first
            context[0] = False
            pos = self.position_ids(i)
            if pos is not None:
                context[1:] &= pos[1:] != 0
            factor = draw_context(context, self.weights.context_positions, (*self.draw_key, int(i), int(step)))
            kl = kl * factor
            if self.has_doc_span and self.weights.document:
                w = w * factor
                labels[factor == 0] = IGNORE  # the head never sees an undrawn document token
        return labels, w, kl

    def position_ids(self, i: int) -> torch.Tensor | None:
        """The row's position ids when it packs several documents (they restart at 0), else None."""
        if not self.has_positions:
            return None
        pos = self.ds[int(i)]["position_ids"].long()
        return pos if bool((pos[1:] == 0).any()) else None

    def loss_targets(self, i: int) -> torch.Tensor:
        """Bool (len - 1,): which next-token targets count (a label, and not the start of another document)."""
        labels = self.row(i)[1]
        keep = labels[1:] != IGNORE
        pos = self.position_ids(i)
        return keep & (pos[1:] != 0) if pos is not None else keep

    def scan(self, vocab_size: int) -> dict:
        """One pass over every row: token-id range check and a content fingerprint."""
        tokens, checksum, low, high = 0, 0, 0, 0
        for start in range(0, len(self.ds), 256):
            for j, ids in enumerate(self.ds[start:start + 256]["input_ids"]):
                tokens += int(ids.numel())
                low, high = min(low, int(ids.min())), max(high, int(ids.max()))
                checksum = (checksum + int(ids[:64].sum()) * (start + j + 1)) % (1 << 61)
        if low < 0 or high >= vocab_size:
            raise RecipeError(f"data: token ids span [{low}, {high}] but the model's vocabulary has {vocab_size} "
                              f"entries; the data was tokenized for another model (re-tokenize with this model's "
                              f"tokenizer)")
        self._fingerprint = {"sequences": len(self.ds), "tokens": tokens, "checksum": checksum}
        return self._fingerprint

    def fingerprint(self) -> dict:
        return self._fingerprint if self._fingerprint is not None else {"sequences": len(self.ds)}


def _is_qa(ds) -> bool:
    return "qa_id" in ds.column_names or "qa_ids" in ds.column_names


def _dataset(columns: dict[str, list]):
    import datasets

    return datasets.Dataset.from_dict(columns)


def random_sequences(n: int, seq_len: int, vocab_size: int, seed: int) -> Sequences:
    """Random tokens (benchmarks, memory tests, exactness tests): every token is a loss token."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab_size, (seq_len,), generator=g).tolist() for _ in range(n)]
    return Sequences(_dataset({"input_ids": ids, "labels": ids}), f"random({n} x {seq_len}, vocab {vocab_size})")


def _is_tokenized(path: Path) -> bool:
    """Rows with input_ids (`longdoc data prepare` output), as opposed to raw documents."""
    if path.is_dir():
        return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()
    if path.suffix == ".parquet" and path.is_file():
        import pyarrow.parquet as pq

        return "input_ids" in pq.read_schema(path).names
    if path.suffix in (".jsonl", ".json") and path.is_file():
        with open(path) as f:
            first = f.readline()
        try:
            return bool(first.strip()) and "input_ids" in json.loads(first)
        except json.JSONDecodeError:
            return False  # the corpus reader reports bad JSON with its line number
    return False


def _load_tokenized(path: Path, seq_len: int):
    import datasets

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        kind = "parquet" if path.suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    if "cu_seqlens" in ds.column_names and "position_ids" not in ds.column_names:
        raise RecipeError(f"data.path: {path} holds packed rows (cu_seqlens) without position_ids; the documents of "
                          f"a row are read from position_ids restarting at 0 (prepare again with `longdoc data "
                          f"prepare --pack`)")
    if "labels" not in ds.column_names:
        ds = ds.add_column("labels", ds["input_ids"])
    lengths = ds["num_tokens"] if "num_tokens" in ds.column_names else [len(x) for x in ds["input_ids"]]
    too_long = sum(1 for n in lengths if n > seq_len)
    if too_long:
        raise RecipeError(f"data.seq_len={seq_len}: {too_long} rows of {path} are longer (prepared with a larger "
                          f"--target-tokens); raise data.seq_len or prepare again")
    return ds


def load_sequences(cfg: DataConfig, tokenizer, vocab_size: int, seed: int, main_first=None,
                   rows_needed: int | None = None) -> Sequences:
    """Rows from `cfg.path`: "random"; tokenized rows (`longdoc data prepare` output: a dataset folder,
    parquet or jsonl with input_ids); or raw documents, tokenized here by `longdoc.corpus.prepare`, which
    caches by content (`main_first`: a context manager letting one rank fill the cache first).

    `rows_needed` (steps x batch size): for QA from raw documents, prepare as many passes over the
    documents as the run consumes, each pass with its own question order (up to `MAX_QA_EPOCHS`)."""
    prepared = False  # rows prepared here from raw documents (_prepare applies max_sequences itself)
    if cfg.path == "random":
        seqs = random_sequences(cfg.random_size, cfg.seq_len, vocab_size, seed)
    else:
        path = Path(cfg.path)
        if _is_tokenized(path):
            seqs = Sequences(_load_tokenized(path, cfg.seq_len), str(path))
        elif not path.exists() and ("/" not in cfg.path or cfg.path.startswith((".", "/", "~"))
                                    or cfg.path.endswith((".jsonl", ".json", ".parquet", ".csv"))):
            raise RecipeError(f"data.path: {path} does not exist; generate documents with `longdoc data synth "
                              f"--domain legal --out {path}` or point data.path at your documents")
        else:
            with main_first() if main_first is not None else contextlib.nullcontext():
                seqs = Sequences(_prepare(cfg, tokenizer, seed, rows_needed), f"{path} ({cfg.task})")
                prepared = True
    if seqs.has_branches != (cfg.task == "preference") and cfg.path != "random":
        raise RecipeError(f"data.task: {cfg.task!r} but {seqs.source} holds " + (
            "preference rows (branches); set data.task: preference" if seqs.has_branches else
            "rows without branches; data.task: preference needs rows of `longdoc data prepare --task preference` "
            "or prompt/chosen/rejected records"))
    if cfg.max_sequences is not None and cfg.max_sequences < len(seqs) and not prepared:
        seqs = Sequences(seqs.ds.select(range(cfg.max_sequences)), seqs.source)
    keep = [i for i in range(len(seqs)) if bool((seqs.row(i)[1][1:] != IGNORE).any())]
    if not keep:
        raise RecipeError(f"data: no training sequence with at least one loss token in {seqs.source} "
                          f"(empty file, or every label masked); check data.path and data.task")
    if len(keep) < len(seqs):
        seqs = Sequences(seqs.ds.select(keep), seqs.source)
    try:
        seqs.scan(vocab_size)
    except RecipeError as e:
        if tokenizer is not None and len(tokenizer) > vocab_size:
            raise RecipeError(f"{e}. The tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                              f"{vocab_size}: tokenizer and model do not match (use the model's own tokenizer, "
                              f"or resize the model's embeddings)") from None
        raise
    return seqs


# Past this many passes the schedule cycles through the prepared ones (a long run on a tiny corpus would
# otherwise tokenize thousands of copies of it).
MAX_QA_EPOCHS = 64


def _prepare(cfg: DataConfig, tokenizer, seed: int, rows_needed: int | None = None):
    from longdoc.corpus.ingest import CorpusError, Fields
    from longdoc.corpus.prepare import prepare

    def run(epochs: int):
        return prepare(cfg.path, tokenizer, task=cfg.task, target_tokens=cfg.seq_len, seed=seed, pack=cfg.pack,
                       fields=Fields(text=cfg.text_field), questions_per_row=cfg.questions_per_row, epochs=epochs,
                       chat_loss=cfg.chat_loss, truncation=cfg.truncation)

    try:
        ds = run(1)
        docs = None
        if cfg.max_sequences is not None and cfg.max_sequences < len(ds):
            # cap the first pass, then keep every pass of just those documents (not the first rows of
            # the passes, which would be a few documents repeated)
            ds = ds.select(range(cfg.max_sequences))
            docs = {d for row in ds["doc_ids"] for d in row}
        if cfg.task == "qa" and rows_needed and rows_needed > len(ds):
            ds = run(min(MAX_QA_EPOCHS, -(-rows_needed // len(ds))))
            if docs is not None:
                ds = ds.filter(lambda ids: all(d in docs for d in ids), input_columns=["doc_ids"])
        return ds
    except (CorpusError, ValueError) as e:
        raise RecipeError(f"data: {e}") from e


def document_keys(seqs: Sequences) -> list[frozenset] | None:
    """The documents each row holds (rows prepared from documents record them), else None."""
    raw = seqs.ds.with_format(None)
    if "doc_ids" not in raw.column_names:
        return None
    return [frozenset(map(str, ids)) for ids in raw["doc_ids"]]


def passes(seqs: Sequences) -> list[int] | None:
    """The pass (epoch) over the documents each row belongs to, when prepared in several passes."""
    raw = seqs.ds.with_format(None)
    return list(raw["epoch"]) if "epoch" in raw.column_names else None


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
    """Number of tokens with a loss (after the causal shift) in these sequences; in a packed row the
    last token of a document predicts nothing."""
    return sum(int(seqs.loss_targets(i).sum()) for i in indices)


def step_denominators(seqs, indices: Sequence[int]) -> tuple[float, int]:
    """(sum of the loss weights, number of KL tokens) over the targets of these rows: the denominators of
    the step's loss (longdoc.train.loss.LossModel). Unweighted rows: (loss_tokens, 0). Every context token
    counts, also where a source draws a few (context_positions): its drawn weights stand for the rest."""
    if not seqs.weighted:
        return float(loss_tokens(seqs, indices)), 0
    total, n_kl = 0.0, 0
    for i in indices:
        labels, w, kl = seqs.targets(i)
        valid = labels[1:] != IGNORE
        pos = seqs.position_ids(i)
        across = pos[1:] == 0 if pos is not None else torch.zeros_like(valid)  # a packed document's end
        total += float(w[1:][valid & ~across].sum())
        n_kl += int(((kl[1:] > 0) & ~across).sum())
    return total, n_kl


def num_tokens(seqs: Sequences, indices: Sequence[int]) -> int:
    return sum(int(seqs.row(i)[0].numel()) for i in indices)


def collate(seqs: Sequences, indices: Sequence[int], pad_id: int, step: int | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) micro-batch: right-padded input_ids and unshifted labels, (batch, max_len); with
    packed rows also position_ids restarting at 0 per document (the padding is one more document). `step`:
    the optimizer step, which draws the context positions of sources with context_positions (Sequences.targets)
    before cp.shard_batch, so every CP rank and every cp size sees the same; none: every context token."""
    rows = [seqs.row(i) for i in indices]
    positions = [seqs.position_ids(i) for i in indices]
    length = max(x.numel() for x, _ in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        ids[r, :x.numel()] = x
        labels[r, :y.numel()] = y
    batch = {"input_ids": ids, "labels": labels}
    if getattr(seqs, "weighted", False):  # per-token loss and KL weights, aligned with the labels
        batch["loss_weights"] = torch.zeros((len(rows), length), dtype=torch.float64)
        batch["kl_weights"] = torch.zeros((len(rows), length), dtype=torch.float64)
        for r, i in enumerate(indices):
            y, w, kl = seqs.targets(i, step)
            labels[r, :y.numel()] = y
            batch["loss_weights"][r, :w.numel()] = w
            batch["kl_weights"][r, :kl.numel()] = kl
    if any(p is not None for p in positions):
        pos = torch.zeros((len(rows), length), dtype=torch.long)
        for r, ((x, _), p) in enumerate(zip(rows, positions)):
            n = x.numel()
            pos[r, :n] = p if p is not None else torch.arange(n)
            pos[r, n:] = torch.arange(length - n)
        batch["position_ids"] = pos
    return batch
