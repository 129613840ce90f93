"""The `data:` section of a training recipe: what to train on, from one path or a weighted mix of sources."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from longdoc.train.recipe_parse import Tokens
from longdoc.train.recipe_parse import check as _check

Task = Literal["qa", "pretrain", "chat", "preference"]
ChatLoss = Literal["assistant", "all"]
Truncation = Literal["left", "right"]
# data.mix sources: QA rows, LM loss on the documents themselves, plain text the user points to (replay),
# and text the base model generates itself (self-synthesised rehearsal; longdoc.corpus.rehearsal)
MixKind = Literal["qa", "documents", "text", "rehearsal"]


@dataclass(kw_only=True, slots=True)
class MixSource:
    """One source of a training mix (`data.mix`): which rows, how often, and how their tokens count.

    The loss of an optimizer step is sum(w * CE) / sum(w) over every target token of the step (w: the
    token's loss weight below) plus, where kl_weight > 0, kl_weight-weighted KL(base || tuned) summed over
    those tokens / their count: both exact under any dp x cp layout (longdoc/train/loss.py)."""

    source: MixKind = "qa"
    path: str = ""  # qa/documents/text: like data.path; rehearsal: the cache file (default: a cache folder)
    weight: float = 1.0  # share of the training rows drawn from this source (normalised over the mix)
    loss_weight: float = 1.0  # loss weight of the source's own targets: answers (qa) or every token
    document_loss_weight: float = 0.0  # qa: loss weight of the document tokens of each row (0: answers only)
    kl_weight: float = 0.0  # KL toward the frozen base (LoRA) on the context tokens: qa documents, else every token
    # document loss and KL at only n of a row's N context positions, drawn per (seed, source, row, optimizer step)
    context_positions: Tokens | None = None  # and weighted x N/n: unbiased, sum(w) kept (train.weights); null: all N
    pack: bool = False  # documents/text/rehearsal: pack short documents into rows of data.seq_len
    text_field: str | None = None  # documents/text: the text field (null picks text/document/content)
    questions_per_row: int | None = None  # qa: as data.questions_per_row
    max_sequences: int | None = None  # use only the first N rows (documents) of this source
    samples: int = 64  # rehearsal: conversations the base model generates (once, then cached)
    max_new_tokens: Tokens = 384  # rehearsal: tokens per generated turn
    seed: int = 0  # rehearsal: sampling seed

    def __post_init__(self):
        kinds = typing.get_args(MixKind)
        _check(self.source in kinds, "data.mix.source", f"must be one of {kinds}, got {self.source!r}")
        _check(self.source == "rehearsal" or bool(self.path), "data.mix.path",
               f"a {self.source!r} source needs a path (documents, text or prepared rows, like data.path)")
        _check(self.weight > 0, "data.mix.weight", f"must be positive (a share of the rows), got {self.weight}")
        for name in ("loss_weight", "document_loss_weight", "kl_weight"):
            _check(getattr(self, name) >= 0, f"data.mix.{name}", f"must be >= 0, got {getattr(self, name)}")
        _check(self.source == "qa" or self.document_loss_weight == 0, "data.mix.document_loss_weight",
               "applies to qa sources only (documents/text sources already train on every token)")
        _check(self.source != "qa" or not self.pack, "data.mix.pack", "applies to documents/text/rehearsal "
               "sources (a QA row already holds one document and its questions)")
        n, sampled = self.context_positions, self.document_loss_weight + self.kl_weight
        _check(n is None or (n > 0 and sampled > 0), "data.mix.context_positions", f"must be null (every context "
               f"token) or a positive count on a source with document_loss_weight or kl_weight > 0, got {n}")
        _check(self.loss_weight + self.document_loss_weight + self.kl_weight > 0, "data.mix.loss_weight",
               "this source would contribute nothing: give it a loss_weight, document_loss_weight or kl_weight")
        _check(self.max_sequences is None or self.max_sequences > 0, "data.mix.max_sequences", "must be positive")
        _check(self.questions_per_row is None or self.questions_per_row > 0, "data.mix.questions_per_row",
               "must be positive, or null for all that fit")
        _check(self.samples > 0 and self.max_new_tokens > 0, "data.mix.samples", "rehearsal samples and "
               "max_new_tokens must be positive")

    @property
    def task(self) -> Task:
        return "qa" if self.source == "qa" else "pretrain"


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = ""  # documents (jsonl/json/parquet/csv/text folder/hub id), `longdoc data prepare` rows, "random"
    seq_len: Tokens = 4096  # tokens per training sequence (window), before CP sharding
    task: Task = "qa"  # for raw documents: "qa" (document + question -> answer, loss on answers) | "pretrain"
    #   | "chat" (conversations: messages [{role, content}] or ShareGPT, in the model's chat template)
    #   | "preference" (prompt/chosen/rejected pairs as shared-prefix rows, longdoc.corpus.preference)
    chat_loss: ChatLoss = "assistant"  # chat: loss on the assistant turns only, or on "all" tokens
    truncation: Truncation = "left"  # chat: an over-long conversation loses its longest non-trained turn's start
    text_field: str | None = None  # pretrain: the documents' text field; null picks text/document/content
    max_sequences: int | None = None  # use only the first N windows (quick runs)
    questions_per_row: int | None = None  # qa: question/answer turns per row; null = all of a document's that fit
    shuffle: bool = True
    random_size: int = 64  # number of sequences when path == "random" (benchmarks, tests)
    pack: bool = False  # pretrain/chat from raw documents: pack short documents (conversations) into rows of seq_len
    # several sources with weights instead of data.path (see MixSource); data.seq_len and shuffle apply to all
    mix: list[MixSource] = field(default_factory=list)

    def __post_init__(self):
        _check(bool(self.path) or bool(self.mix), "data.path", "name a jsonl file or folder (make one with "
               "`longdoc data synth --domain legal`), 'random' for random tokens, or give data.mix")
        _check(not (self.path and self.mix), "data.mix", "cannot be combined with data.path: put that path in the "
               "mix as a source ({source: qa, path: ...})")
        _check(self.task in typing.get_args(Task), "data.task", f"must be one of {typing.get_args(Task)}, got "
               f"{self.task!r}")
        _check(self.chat_loss in typing.get_args(ChatLoss), "data.chat_loss",
               f"must be one of {typing.get_args(ChatLoss)}, got {self.chat_loss!r}")
        _check(self.truncation in typing.get_args(Truncation), "data.truncation",
               f"must be one of {typing.get_args(Truncation)}, got {self.truncation!r}")
        _check(self.seq_len >= 2, "data.seq_len", f"must be at least 2 tokens, got {self.seq_len}")
        _check(self.max_sequences is None or self.max_sequences > 0, "data.max_sequences", "must be positive")
        _check(self.questions_per_row is None or self.questions_per_row > 0, "data.questions_per_row",
               f"must be positive, or null for all that fit, got {self.questions_per_row}")
        _check(self.random_size > 0, "data.random_size", "must be positive")
