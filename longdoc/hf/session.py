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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from longdoc.hf import attention as backend
from longdoc.hf import kinds, modelinfo
from longdoc.hf.decode import Sampler, ShardedCache, cache_layers
from longdoc.parallel import comm
from longdoc.parallel import layout as layouts
from longdoc.parallel.api import ContextParallel, check_strategy
from longdoc.parallel.batch import CPInputError, checksum

__all__ = ["KVSession", "Generation", "generate"]


@dataclass
class Generation:
    """Decoding output, identical on every rank."""

    tokens: torch.Tensor  # (batch, new_tokens) generated ids; after its EOS a row holds pad_token_id (transformers')
    logits: torch.Tensor | None = None  # (batch, new_tokens, vocab) fp32 logits that chose them, if asked


class KVSession:
    """A context-parallel KV-cache session over one batch of equal-length prompts (see the module docstring).

    Use as a context manager: entering sets the session on the model's handle, leaving removes it.
    """

    def __init__(self, model: torch.nn.Module, cp: ContextParallel, *, strategy: str = "ring") -> None:
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a longdoc.ContextParallel, got {type(cp).__name__}")
        self.model, self.cp, self.hf = model, cp, modelinfo.hf_model(model)
        self.name = modelinfo.model_name(self.hf)
        modelinfo.check_config(self.hf.config, self.name, kinds.layer_types(self.hf))
        own = modelinfo.own_loss_problem(self.hf)
        if own is not None and "position_ids" in own[0]:  # the loss does not matter here, the positions do
            raise modelinfo.refuse(self.name, "positions taken from each call's token index (it accepts no "
                                   "position_ids)", own[1])
        undecoded = sorted({k.name for _, _, k in kinds.find(self.hf) if not k.decode})
        if undecoded:
            raise modelinfo.refuse(self.name, f"{', '.join(undecoded)} layers in a KV session (decoding)",
                                   "these layers do not carry their state into CP decoding yet; score with a "
                                   "plain forward of the patched model instead")
        self.n_attention = kinds.attention_layers(self.hf.config, modelinfo.num_layers(self.hf.config), self.hf)
        self.state = backend.Session(cp, check_strategy(strategy, cp))
        self.cache = ShardedCache(cache_layers(self.hf.config, self.state))
        self._snapshots: dict[int, list] = {}  # length -> recurrent states at a mark (models with recurrent layers)
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
            problem = kinds.problems(hf, handle)
            if problem is not None:
                raise modelinfo.refuse(self.name, *problem)
            backend.set_implementation(hf, backend.NAME)
            backend.attach(hf, handle)
            kinds.attach(hf, handle)
        handle.session = self.state
        self._handle = handle
        return self

    def __exit__(self, *exc) -> None:
        handle, self._handle = self._handle, None
        handle.session = None
        self.state.mode = "idle"
        if self._restore is not None:
            kinds.detach(self.hf)
            backend.attach(self.hf, None)
            backend.set_implementation(self.hf, self._restore)
            self._restore = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, logits_to_keep) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError("use KVSession as a context manager: `with KVSession(model, cp) as s: ...`")
        self._handle.attention_calls = 0
        self._handle.kind_calls = {}
        with torch.no_grad():
            if positions.dim() == 1:  # the same positions for every row; (batch, len) ones are per row (branches)
                positions = positions.unsqueeze(0).expand(ids.shape[0], -1)
            out = self.hf(input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True,
                          logits_to_keep=logits_to_keep)
        backend.check_all_layers(self._handle, self.n_attention)
        kinds.check_calls(self._handle, kinds.expected_calls(self.hf))
        return out.logits.float()

    def branch_problem(self) -> str | None:
        """Why this model cannot decode several rows over one prompt (longdoc.hf.branches), None when it can:
        a layer kind beyond plain attention, or a pattern that depends on more than token order."""
        found = sorted({k.name for _, _, k in kinds.find(self.hf)})
        if found:
            return f"{', '.join(found)} layers"
        text = self.hf.config.get_text_config() if hasattr(self.hf.config, "get_text_config") else self.hf.config
        if set(getattr(text, "layer_types", None) or ()) - {"full_attention"} or (
                getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)):
            return "sliding-window or other non-full attention layers"
        for key in ("attention_chunk_size", "attn_logit_softcapping"):
            if getattr(text, key, None):
                return key
        if any("sinks" in name for name, _ in self.hf.named_parameters()):
            return "attention sinks"
        return None

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
        every = [layouts.positions(padded, r, cp.size, cp.layout, device=ids.device) for r in range(cp.size)]
        self.state.rank_positions = [p[p < seq] for p in every]
        self.counts = [int(p.numel()) for p in self.state.rank_positions]
        self.length, self.batch = seq, ids.shape[0]
        if cp.size > 1:
            logits = comm.all_gather(logits.contiguous(), cp.group, cp.timeout, cp.guard, "all_gather logits")[holder]
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
        self.state.rank_positions[owner] = torch.cat([self.state.rank_positions[owner], positions])
        self.counts[owner] += new
        self.length += new
        return logits

    def mark(self) -> tuple[int, ...]:
        """The session's position, for `rollback` (e.g. after the shared document, before each question).
        Recurrent layers' states are copied here (attention caches roll back by truncation)."""
        if self.cache.recurrent:
            self._snapshots[self.length] = self.cache.snapshot()
        return (self.length, *self.counts)

    def rollback(self, mark: tuple[int, ...]) -> None:
        """Forget every token appended after `mark` (prefill tokens are never dropped)."""
        length, *counts = mark
        if length > self.length or any(c > now for c, now in zip(counts, self.counts)):
            raise ValueError(f"cannot roll back forward: mark {mark} is after the session's {self.mark()}")
        if self.cache.recurrent and length != self.length:
            if length not in self._snapshots:
                raise ValueError(f"cannot roll back {self.name} to {mark}: its recurrent layers' state there was not "
                                 f"kept (it is copied by mark(); take the mark again after the last rollback)")
            self.cache.restore(self._snapshots[length])
        self._snapshots = {n: s for n, s in self._snapshots.items() if n <= length}
        self.cache.truncate(counts[self.cp.rank])
        self.state.key_positions = self.state.key_positions[:counts[self.cp.rank]]
        self.state.rank_positions = [p[:c] for p, c in zip(self.state.rank_positions, counts)]
        self.length, self.counts = length, list(counts)

    # ---- decoding ----

    def decode(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
               sampler: Sampler | None = None, seed: int | None = None, return_logits: bool = False,
               stop: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Generation:
        """Decode from `logits` (batch, vocab), the logits after the last token so far: greedy, or sampled
        with `sampler` from a generator seeded with `seed` (None: torch's global generator, on rank 0).
        `stop(tokens)`, given the (batch, steps) tokens so far, returns a (batch,) bool tensor of rows that are
        done (e.g. a stop string appeared); the tokens are the same on every rank, so must its answer be."""
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
            if stop is not None:
                finished |= stop(torch.stack(tokens, dim=1)).to(finished.device)
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
        return comm.all_gather(token.contiguous(), self.cp.group, self.cp.timeout, self.cp.guard, "all_gather token")[0]

    def _agree(self, what: str, ids: torch.Tensor) -> None:
        """Before any collective of a call: all ranks pass the same ids at the same point, or all raise."""
        if self.cp.size == 1 or not self.cp.check_agreement:
            return
        mine = [*ids.shape, self.length, checksum(ids)]
        metas = comm.agree(mine, self.cp.group, self.cp.timeout, self.cp.comm_device(ids.device), self.cp.guard,
                           f"agree {what}")
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


def generation_settings(model: torch.nn.Module, **given) -> dict:
    """`given` with every None taken from the model's generation_config, as `model.generate` does: the EOS it
    stops at, the pad id after it (the EOS when the config has none), do_sample, temperature, top_p, top_k and
    max_new_tokens. Sampling knobs apply only when sampling; an explicit value always wins."""
    config = getattr(modelinfo.hf_model(model), "generation_config", None)
    out = {k: (getattr(config, k, None) if v is None else v) for k, v in given.items()}
    if "pad_token_id" in out and out["pad_token_id"] is None:
        eos = out.get("eos_token_id")
        out["pad_token_id"] = eos if isinstance(eos, int) or eos is None else (list(eos) or [None])[0]
    if not out.get("do_sample"):
        out.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=None)
    else:
        for key, default in (("temperature", 1.0), ("top_p", 1.0)):
            out[key] = default if out.get(key) is None else out[key]
        if given.get("top_k") is None and out.get("top_k") == 0:  # a config's top_k 0 means no top-k filter
            out["top_k"] = None
    return out


def generate(model: torch.nn.Module, cp: ContextParallel, input_ids: torch.Tensor, max_new_tokens: int | None = None,
             *, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             do_sample: bool | None = None, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, seed: int | None = None, strategy: str = "ring", return_logits: bool = False,
             attention_mask: torch.Tensor | None = None) -> Generation:
    """Decode after a context-parallel prefill of `input_ids` (batch, len), the same prompt on every rank.

    Every setting left None comes from the model's generation_config, as in `model.generate`: decoding stops at
    its EOS (pass eos_token_id=[] to always decode max_new_tokens), a finished row holds pad_token_id after it,
    and it samples only if the config says so. Greedy otherwise; do_sample=True samples (temperature, top-k,
    top-p, in transformers' order) from a generator seeded with `seed` (None: torch's global generator). Rank 0's
    choice is every rank's, so the result is identical on all ranks, and for one seed the same tokens at any cp
    size (up to rounding ties).
    `attention_mask` (batch, len) with left padding: every prompt is decoded on its own without its pads
    (positions from 0, as transformers numbers a left-padded prompt), so pads see nothing and count nothing.
    Works on patched and unpatched models; the model is left as it was.
    """
    opts = generation_settings(model, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id, do_sample=do_sample, temperature=temperature, top_p=top_p,
                               top_k=top_k)
    if opts["max_new_tokens"] is None:
        raise ValueError("generate: pass max_new_tokens (the model's generation_config sets none)")
    _check_max_new_tokens(opts["max_new_tokens"])  # before the prefill's compute
    sampler = Sampler(opts["do_sample"], float(opts["temperature"]), float(opts["top_p"]), opts["top_k"])
    eos, steps = opts["eos_token_id"], int(opts["max_new_tokens"])
    ids = torch.as_tensor(input_ids)
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0)
    lead = left_padding(attention_mask, tuple(ids.shape))
    if lead is None:
        with KVSession(model, cp, strategy=strategy) as session:
            logits = session.prefill(ids)
            return _padded(session.decode(logits, steps, eos, sampler, seed, return_logits), eos, opts["pad_token_id"])
    rows = []
    for r, n in enumerate(lead):  # one session per prompt: rows of different lengths share no cache layout
        with KVSession(model, cp, strategy=strategy) as session:
            logits = session.prefill(ids[r:r + 1, n:])
            rows.append(session.decode(logits, steps, eos, sampler, None if seed is None else seed + r, return_logits))
    width = max(g.tokens.shape[1] for g in rows)

    def widen(t: torch.Tensor) -> torch.Tensor:  # a row that stopped early repeats its last (EOS) step
        return torch.cat([t, t[:, -1:].expand(-1, width - t.shape[1], *t.shape[2:])], dim=1)

    return _padded(Generation(torch.cat([widen(g.tokens) for g in rows]),
                              torch.cat([widen(g.logits) for g in rows]) if return_logits else None),
                   eos, opts["pad_token_id"])


def _padded(gen: Generation, eos, pad) -> Generation:
    """After a row's first EOS, pad_token_id, as transformers fills finished rows (the session repeats the EOS)."""
    if eos is None or pad is None or (not isinstance(eos, int) and not list(eos)):
        return gen
    tokens = gen.tokens
    is_eos = torch.isin(tokens, torch.as_tensor(eos, device=tokens.device).reshape(-1))
    return Generation(tokens.masked_fill(is_eos.cumsum(dim=1) - is_eos.long() > 0, int(pad)), gen.logits)
