"""Decoding with a causal LM under context parallelism: the KV session and `generate`.

    out = longdoc.hf.generate(model, cp, prompt_ids, max_new_tokens=32)              # greedy
    out = longdoc.hf.generate(model, cp, prompt_ids, 32, do_sample=True, top_p=0.9, seed=0)
    out.tokens                                       # (batch, new) ids, identical on every rank

    with KVSession(model, cp) as s:                  # model: a transformers causal LM (patched or not)
        logits = s.prefill(prompt_ids)               # CP forward; each rank keeps the K/V of ITS tokens
        mark = s.mark(); s.extend(question_ids)      # more tokens after the shared prompt ...
        s.rollback(mark)                             # ... and back
        out = s.greedy(logits, max_new_tokens=32)

Every rank of `cp` makes the same calls with the same token ids (checked). The decode mathematics is in
longdoc.hf.decode. The session runs the model's own code through the "longdoc_cp" backend: on a patched
model it only sets the session on the model's handle (the patch stays); on an unpatched one it puts a
temporary handle and switches the attention implementation for the session, restoring both on exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longdoc.hf import attention as backend
from longdoc.hf import modelinfo
from longdoc.hf.decode import Sampler, ShardedCache
from longdoc.parallel import comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.api import ContextParallel, check_strategy
from longdoc.parallel.batch import CPInputError, checksum

__all__ = ["KVSession", "Generation", "generate"]


@dataclass
class Generation:
    """Decoding output, identical on every rank."""

    tokens: torch.Tensor  # (batch, new_tokens) generated ids; after an EOS a row repeats that EOS
    logits: torch.Tensor | None = None  # (batch, new_tokens, vocab) fp32 logits that chose them, if asked


class KVSession:
    """A context-parallel KV-cache session over one batch of equal-length prompts (see the module docstring).

    Use as a context manager: entering sets the session on the model's handle, leaving removes it.
    """

    def __init__(self, model: torch.nn.Module, cp: ContextParallel, *, strategy: str = "ring"):
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a longdoc.ContextParallel, got {type(cp).__name__}")
        self.model, self.cp, self.hf = model, cp, modelinfo.hf_model(model)
        self.name = modelinfo.model_name(self.hf)
        modelinfo.check_config(self.hf.config, self.name)
        self.state = backend.Session(cp, check_strategy(strategy))
        self.cache = ShardedCache()
        self.counts = [0] * cp.size  # cached tokens per rank: identical arithmetic on every rank
        self.length = 0  # global tokens so far
        self.batch = 0
        self._handle: backend.CPHandle | None = None
        self._restore: str | None = None  # the implementation to switch back to (unpatched models)

    # ---- context management ----

    def __enter__(self) -> KVSession:
        hf = self.hf
        handle = getattr(hf, "_longdoc_cp", None)
        if handle is not None and handle.cp is None:
            backend.handle_of(hf)  # raises: an unpickled patched model
        if handle is not None and handle.session is not None:
            raise RuntimeError(f"{self.name} already runs a KVSession; finish it before starting another")
        if handle is None:
            self._restore = hf.config._attn_implementation
            handle = backend.CPHandle(self.cp, self.state.strategy, self.name, hf.config, patched=False)
            backend.set_implementation(hf, backend.NAME)
            backend.attach(hf, handle)
        handle.session = self.state
        self._handle = handle
        return self

    def __exit__(self, *exc) -> None:
        handle, self._handle = self._handle, None
        handle.session = None
        self.state.mode = "idle"
        if self._restore is not None:
            backend.attach(self.hf, None)
            backend.set_implementation(self.hf, self._restore)
            self._restore = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError("use KVSession as a context manager: `with KVSession(model, cp) as s: ...`")
        self._handle.attention_calls = 0
        with torch.no_grad():
            out = self.hf(input_ids=ids, position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1),
                          cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        backend.check_all_layers(self._handle, modelinfo.num_layers(self.hf.config))
        return out.logits.float()

    # ---- prefill / extend ----

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt (batch, len), identical on all ranks, through the model with CP; returns the
        logits after its last token, (batch, vocab) fp32, identical on all ranks."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        if self.length:
            raise RuntimeError("prefill starts a session; this one already holds tokens (use a new KVSession)")
        cp, seq = self.cp, ids.shape[1]
        self._agree("prefill", ids)
        if seq == 0:
            raise ValueError("prefill needs at least one prompt token")
        self._check_rope(seq)
        padded = layouts.round_up(seq, cp.multiple)
        full = torch.nn.functional.pad(ids, (0, padded - seq), value=0)  # pad ids never reach a real token
        positions = cp.positions(padded, device=ids.device)
        # The logits of the last prompt token: kept (computed) by the rank holding it only.
        holder = next(r for r in range(cp.size) if bool((layouts.positions(padded, r, cp.size, cp.layout)
                                                           == seq - 1).any()))
        mine = torch.nonzero(positions == seq - 1).flatten()
        keep = mine if cp.rank == holder else torch.zeros(1, dtype=torch.long, device=ids.device)
        self.state.mode, self.state.total, self.cache.append = "prefill", seq, True
        logits = self._forward(cp.shard(full, dim=1), positions, keep)[:, -1]
        self.cache.keep(torch.nonzero(positions < seq).flatten())  # drop the padding's K/V
        self.state.key_positions = positions[positions < seq]  # in cache order: windows mask by position
        self.counts = [int((layouts.positions(padded, r, cp.size, cp.layout) < seq).sum()) for r in range(cp.size)]
        self.length, self.batch = seq, ids.shape[0]
        if cp.size > 1:
            logits = comm.all_gather(logits.contiguous(), cp.group, cp.timeout)[holder]
        return logits

    def extend(self, input_ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Append tokens (batch, new) after everything so far; returns the logits after each of the last
        `keep` of them, (batch, keep, vocab) fp32, identical on all ranks."""
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
        self._agree("extend", ids)
        if not self.length:
            raise RuntimeError("call prefill before extend")
        if ids.shape[0] != self.batch:
            raise ValueError(f"extend got a batch of {ids.shape[0]}, the session holds {self.batch}")
        new = ids.shape[1]
        if not 1 <= keep <= new:
            raise ValueError(f"keep must be in [1, {new}] for {new} new tokens, got {keep}")
        self._check_rope(self.length + new)
        owner = min(range(self.cp.size), key=lambda r: (self.counts[r], r))
        positions = torch.arange(self.length, self.length + new, device=ids.device)
        self.state.mode, self.state.total = "extend", self.length + new
        self.state.appending = self.cache.append = owner == self.cp.rank
        try:
            logits = self._forward(ids, positions, keep)
        finally:
            self.cache.append = True
        if owner == self.cp.rank:
            self.state.key_positions = torch.cat([self.state.key_positions, positions])
        self.counts[owner] += new
        self.length += new
        return logits

    def mark(self) -> tuple[int, ...]:
        """The session's position, for `rollback` (e.g. after the shared document, before each question)."""
        return (self.length, *self.counts)

    def rollback(self, mark: tuple[int, ...]) -> None:
        """Forget every token appended after `mark` (prefill tokens are never dropped)."""
        length, *counts = mark
        if length > self.length or any(c > now for c, now in zip(counts, self.counts)):
            raise ValueError(f"cannot roll back forward: mark {mark} is after the session's {self.mark()}")
        self.cache.truncate(counts[self.cp.rank])
        self.state.key_positions = self.state.key_positions[:counts[self.cp.rank]]
        self.length, self.counts = length, list(counts)

    # ---- decoding ----

    def decode(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
               sampler: Sampler | None = None, seed: int | None = None, return_logits: bool = False) -> Generation:
        """Decode from `logits` (batch, vocab), the logits after the last token so far: greedy, or sampled
        with `sampler` from a generator seeded with `seed` (None: torch's global generator, on rank 0)."""
        _check_max_new_tokens(max_new_tokens)
        sampler = sampler or Sampler()
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                           dtype=torch.long, device=logits.device)
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        last = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        tokens, seen = [], []
        for step in range(max_new_tokens):
            nxt = self._rank0(sampler.choose(logits, generator))
            nxt = torch.where(finished, last, nxt)  # a finished row repeats its EOS
            tokens.append(nxt)
            if return_logits:
                seen.append(logits)
            finished |= torch.isin(nxt, eos)
            last = nxt
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits = self.extend(nxt.unsqueeze(1))[:, -1]
        return Generation(torch.stack(tokens, dim=1), torch.stack(seen, dim=1) if return_logits else None)

    def greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
               return_logits: bool = False) -> Generation:
        """Greedy decoding from `logits` (batch, vocab), the logits after the last token so far."""
        return self.decode(logits, max_new_tokens, eos_token_id, return_logits=return_logits)

    def _rank0(self, token: torch.Tensor) -> torch.Tensor:
        # Ranks compute the same logits, but a near-tie could still round differently on one of them (and an
        # unseeded draw differs per rank): rank 0 decides, so the caches never diverge.
        if self.cp.size == 1:
            return token
        return comm.all_gather(token.contiguous(), self.cp.group, self.cp.timeout)[0]

    def _agree(self, what: str, ids: torch.Tensor) -> None:
        """Before any collective of a call: all ranks pass the same ids at the same point, or all raise."""
        if self.cp.size == 1 or not self.cp.check_agreement:
            return
        mine = [*ids.shape, self.length, checksum(ids)]
        metas = comm.agree(mine, self.cp.group, self.cp.timeout, self.cp.comm_device(ids.device))
        if any(m[:-1] != metas[0][:-1] for m in metas):
            detail = "; ".join(f"rank {r}: ids {tuple(m[:-2])} after {m[-2]} tokens" for r, m in enumerate(metas))
            raise ValueError(f"KVSession.{what}: CP ranks disagree ({detail}); every rank must make the same calls "
                             f"with the same token ids")
        if any(m != metas[0] for m in metas):
            raise CPInputError(f"KVSession.{what}: the CP ranks passed different token ids of the same shape; every "
                               f"rank of a CP group must decode the same prompt (read it identically on every rank)")

    def _check_rope(self, length: int) -> None:
        limit = modelinfo.rope_limit(self.hf.config)
        if limit is not None and length > limit[1]:
            raise modelinfo.refuse(self.name, f"RoPE scaling {limit[0]!r} at {length} tokens (beyond its "
                                 f"{limit[1]}-token threshold)", "it picks frequencies from the largest position "
                                 "each rank sees; use a static RoPE scaling or shorter inputs")


def _check_max_new_tokens(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")


def left_padding(attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> list[int] | None:
    """Leading pads per row of a prompt mask, None when there is no padding; raises unless every row is
    pads then real tokens (generation pads on the left: padding_side='left')."""
    if attention_mask is None:
        return None
    m = torch.as_tensor(attention_mask).to(torch.int8).reshape(shape)
    if bool(m.all()):
        return None
    if m.shape[1] > 1 and not bool((m[:, 1:] >= m[:, :-1]).all()) or not bool(m[:, -1].all()):
        raise ValueError("generate: attention_mask must be left padding (zeros, then ones, every row ending in a real "
                         "token); tokenize prompts with tokenizer.padding_side = 'left'")
    return [int(n) for n in (m == 0).sum(dim=1)]


def generate(model: torch.nn.Module, cp: ContextParallel, input_ids: torch.Tensor, max_new_tokens: int, *,
             eos_token_id: int | list[int] | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int | None = None, seed: int | None = None, strategy: str = "ring",
             return_logits: bool = False, attention_mask: torch.Tensor | None = None) -> Generation:
    """Decode after a context-parallel prefill of `input_ids` (batch, len), the same prompt on every rank.

    Greedy by default; do_sample=True samples (temperature, top-k, top-p, in transformers' order) from a
    generator seeded with `seed` (None: torch's global generator). Rank 0's choice is every rank's, so the
    result is identical on all ranks, and for one seed the same tokens at any cp size (up to rounding ties).
    `attention_mask` (batch, len) with left padding: every prompt is decoded on its own without its pads
    (positions from 0, as transformers numbers a left-padded prompt), so pads see nothing and count nothing.
    Works on patched and unpatched models; the model is left as it was.
    """
    _check_max_new_tokens(max_new_tokens)  # before the prefill's compute
    sampler = Sampler(do_sample, float(temperature), float(top_p), top_k)
    ids = torch.as_tensor(input_ids)
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0)
    lead = left_padding(attention_mask, tuple(ids.shape))
    if lead is None:
        with KVSession(model, cp, strategy=strategy) as session:
            logits = session.prefill(ids)
            return session.decode(logits, max_new_tokens, eos_token_id, sampler, seed, return_logits)
    rows = []
    for r, n in enumerate(lead):  # one session per prompt: rows of different lengths share no cache layout
        with KVSession(model, cp, strategy=strategy) as session:
            logits = session.prefill(ids[r:r + 1, n:])
            rows.append(session.decode(logits, max_new_tokens, eos_token_id, sampler,
                                       None if seed is None else seed + r, return_logits))
    width = max(g.tokens.shape[1] for g in rows)

    def widen(t: torch.Tensor) -> torch.Tensor:  # a row that stopped early repeats its last (EOS) step
        return torch.cat([t, t[:, -1:].expand(-1, width - t.shape[1], *t.shape[2:])], dim=1)

    return Generation(torch.cat([widen(g.tokens) for g in rows]),
                      torch.cat([widen(g.logits) for g in rows]) if return_logits else None)
