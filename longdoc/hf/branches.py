"""Several continuations of one cached prompt, decoded as one batch under context parallelism.

    with KVSession(model, cp) as s:
        s.prefill(document_ids)                       # (1, len): the shared prefix, CP-sharded as always
        with Branches(s, rows=len(questions)) as br:
            last = br.extend(question_ids)            # one list of ids per row, any lengths -> (rows, vocab)
            mark = br.mark()
            scored = br.extend(answer_ids, keep_all=True)   # per row (len, vocab) teacher-forced logits
            br.rollback(mark)
            tokens = br.greedy(last, max_new_tokens=24, eos_token_id=stops)  # finished rows are dropped

Every question about a document shares the document's prefill: decoding them one at a time pays one full
forward of the model per generated token per question; here one forward serves every row. The prefix's K/V
stay where the prefill put them (each rank its own shard, batch 1, never copied per row). Each row's own
tokens (question, answer, generated ids) are few: their K/V are kept on EVERY rank, (rows, kv_heads, slots,
head_dim) per layer, with a (rows, slots) mask of which slots hold a real token of that row (rows of different
lengths are right-padded; a pad slot is never a key). Attention of the new queries is then the log-sum-exp merge
of two exact partials: over the prefix (every row's queries as one batch-1 block against each rank's shard,
all-gathered and merged in rank order, as `extend_attention` does) and over the row's own slots (causal in slot
order, identical on every rank). Positions are each row's true global positions, so RoPE sees what a one-row
session would. The results equal one-question-at-a-time decoding up to rounding (the matmuls see more rows).

Layers whose keys depend on more than order (sliding windows, chunks, soft-capping, sinks, sparse indexed
attention) and recurrent layers are not branched: `KVSession.branch_problem()` says so before any compute, and
callers decode such models one row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longdoc.parallel import blocks, comm, kernels

__all__ = ["BranchState", "Branches", "branch_attention", "greedy_each"]


class BranchState:
    """The rows' own K/V per attention layer and the (rows, slots) mask of real tokens, the same on every rank."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (rows, kv_heads, slots, head_dim)
        self.values: dict[int, torch.Tensor] = {}
        self.valid = torch.zeros((rows, 0), dtype=torch.bool, device=device)  # (rows, slots)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if layer in self.keys:
            key, value = torch.cat([self.keys[layer], key], dim=-2), torch.cat([self.values[layer], value], dim=-2)
        self.keys[layer], self.values[layer] = key, value

    def truncate(self, slots: int) -> None:
        self.keys = {i: k[..., :slots, :] for i, k in self.keys.items()}
        self.values = {i: v[..., :slots, :] for i, v in self.values.items()}
        self.valid = self.valid[:, :slots]

    def keep(self, rows: torch.Tensor) -> None:
        self.keys = {i: k.index_select(0, rows) for i, k in self.keys.items()}
        self.values = {i: v.index_select(0, rows) for i, v in self.values.items()}
        self.valid = self.valid.index_select(0, rows)


def branch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BranchState, layer: int, cp,
                     scale: float, pattern=None, selected: torch.Tensor | None = None) -> torch.Tensor:
    """q (rows, q_heads, new, head_dim) of the rows' new tokens over the prefix shard k/v (1, kv_heads, local,
    head_dim) of this rank and the rows' own slots in `state` (the new tokens' K/V already appended). Returns
    (rows, q_heads, new, head_dim), identical on every rank. KVSession.branch_problem refuses every `pattern`
    (longdoc.hf.attention.LayerPattern) but plain causal attention before any compute; this is the backstop."""
    if selected is not None or pattern is not None and any(x is not None for x in pattern.kwargs().values()):
        raise ValueError("branches cannot decode a layer with a window, chunks, soft-capping, sinks or indexed keys")
    rows, hq, new, d = q.shape
    acc = kernels.lse_dtype(q.dtype)
    # The prefix: every key precedes every query, so all rows' queries are one unmasked batch-1 block.
    flat = q.transpose(0, 1).reshape(1, hq, rows * new, d)  # (1, q_heads, rows * new, head_dim)
    if k.shape[2]:
        out, lse = kernels.select(q.device, q.dtype, cp.kernel).forward(flat, k.contiguous(), v.contiguous(),
                                                                         False, scale)
        out, lse = out.to(acc), lse.to(acc)
    else:
        out, lse = flat.new_zeros(flat.shape, dtype=acc), flat.new_full(flat.shape[:3], float("-inf"), dtype=acc)
    if cp.size > 1:
        parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1), cp.group, cp.timeout, cp.guard,
                                "all_gather branch out|lse")
        out, lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
        for part in parts:  # rank order on every rank: bit-identical results everywhere
            out, lse = blocks.merge(out, lse, part[..., :-1], part[..., -1])
    out = out[0].reshape(hq, rows, new, -1).transpose(0, 1)  # (rows, q_heads, new, head_dim)
    lse = lse[0].reshape(hq, rows, new).transpose(0, 1)
    # The rows' own slots: causal in slot order (the new tokens are the last `new` slots), real tokens only.
    kb, vb = state.keys[layer], state.values[layer]  # (rows, kv_heads, slots, head_dim)
    hkv, slots = kb.shape[1], kb.shape[2]
    slot = torch.arange(slots, device=q.device)
    seen = state.valid[:, None, :] & (slot[None, None, :] <= (slots - new + slot[:new])[None, :, None])
    qg = q.to(acc).reshape(rows, hkv, hq // hkv, new, d)  # (rows, kv_heads, group, new, head_dim)
    s = torch.matmul(qg, kb.to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # (rows, kv_heads, group, new, slots)
    s = s.masked_fill(~seen[:, None, None], float("-inf"))
    t_lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(t_lse), torch.full_like(t_lse, float("inf")), t_lse)
    t_out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), vb.to(acc).unsqueeze(2))
    out, _ = blocks.merge(out, lse, t_out.reshape(rows, hq, new, -1), t_lse.reshape(rows, hq, new))
    return out.to(q.dtype)


class Branches:
    """`rows` continuations of a KVSession's prompt as one batch (see the module docstring). Every rank makes the
    same calls with the same ids; leaving the block forgets every row and leaves the session as it was."""

    def __init__(self, session, rows: int) -> None:
        problem = session.branch_problem()
        if problem is not None:
            raise ValueError(f"{session.name}: cannot decode branches of one prompt with {problem}; decode one row at "
                             f"a time")
        if not session.length:
            raise RuntimeError("Branches need a prefilled KVSession (call prefill first)")
        if session.batch != 1:
            raise ValueError(f"Branches continue a prompt of batch 1, the session holds {session.batch}")
        if rows < 1:
            raise ValueError(f"Branches need at least one row, got {rows}")
        self.session = session
        self.state = BranchState(rows, session.state.key_positions.device)
        self._mode = session.state.mode

    def __enter__(self) -> Branches:
        s = self.session
        s.state.mode, s.state.branch, s.cache.branch = "branch", self.state, self.state
        return self

    def __exit__(self, *exc) -> None:
        s = self.session
        s.state.mode, s.state.branch, s.cache.branch = self._mode, None, None

    @property
    def rows(self) -> int:
        return self.state.valid.shape[0]

    def positions(self) -> torch.Tensor:
        """(rows,) the global position each row's next token takes."""
        return self.session.length + self.state.valid.sum(dim=1)

    def extend(self, ids: Sequence[Sequence[int]] | torch.Tensor, keep_all: bool = False):
        """Append each row's ids (a list per row, lengths may differ; a 1-D tensor is one token per row).
        Returns (rows, vocab) fp32 logits after each row's last new token, or with `keep_all` a list of
        (len_r, vocab) logits after each of row r's new tokens."""
        if isinstance(ids, torch.Tensor):
            ids = [[int(t)] for t in ids.reshape(-1)]
        if len(ids) != self.rows:
            raise ValueError(f"Branches.extend got {len(ids)} rows, the branches hold {self.rows}")
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.long)
        if not keep_all and int(lengths.min()) < 1:
            raise ValueError("Branches.extend: every row needs at least one new token (or keep_all=True)")
        s, device = self.session, self.state.valid.device
        width = max(int(lengths.max()), 1)
        batch = torch.zeros((self.rows, width), dtype=torch.long)
        for r, row in enumerate(ids):
            batch[r, :len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        batch = batch.to(device)
        s._agree("branch extend", torch.cat([batch, lengths.to(device).unsqueeze(1)], dim=1))
        positions = self.positions().unsqueeze(1) + torch.arange(width, device=device)  # (rows, width)
        s._check_rope(int(positions.max()) + 1)
        real = torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]
        self.state.valid = torch.cat([self.state.valid, real], dim=1)
        last = (lengths - 1).clamp_min(0).to(device)
        keep = 0 if keep_all else torch.unique(last)
        logits = s._forward(batch, positions, keep)  # (rows, kept, vocab)
        if keep_all:
            return [logits[r, :int(n)] for r, n in enumerate(lengths)]
        return logits[torch.arange(self.rows, device=device), torch.searchsorted(keep, last)]

    def mark(self) -> int:
        return self.state.valid.shape[1]

    def rollback(self, mark: int) -> None:
        """Forget every slot appended after `mark` (all rows)."""
        if mark > self.mark():
            raise ValueError(f"cannot roll back forward: mark {mark} is after the branches' {self.mark()} slots")
        self.state.truncate(mark)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (1-D indices), in that order."""
        self.state.keep(rows.to(self.state.valid.device))

    def greedy(self, logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None
               ) -> list[list[int]]:
        """Greedy decoding of every row from `logits` (rows, vocab); a row stops at its first EOS (kept) and
        leaves the batch, so later steps compute only the rows still running. Returns the ids per row."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                           dtype=torch.long, device=logits.device)
        active = list(range(self.rows))
        out: list[list[int]] = [[] for _ in active]
        for step in range(max_new_tokens):
            nxt = self.session._rank0(logits.argmax(dim=-1))
            for r, t in zip(active, nxt.tolist()):
                out[r].append(t)
            running = torch.nonzero(~torch.isin(nxt, eos)).flatten()
            if step == max_new_tokens - 1 or running.numel() == 0:
                break
            if running.numel() < len(active):
                self.keep(running)
                active, nxt = [active[i] for i in running.tolist()], nxt[running]
            logits = self.extend(nxt)
        return out


def greedy_each(session, suffixes: Sequence[Sequence[int]], max_new_tokens: int,
                eos_token_id: int | list[int] | None = None, batch: int = 16) -> list[list[int]]:
    """Greedy continuations of each of `suffixes` (ids after the session's prefilled prompt, e.g. one question
    each), all over that one prefill: up to `batch` rows decoded together as Branches, or one at a time with
    rollback when `batch` is 1 or the model cannot branch (`KVSession.branch_problem`). The same tokens either
    way up to rounding; the session is left as it was."""
    out: list[list[int]] = []
    if batch > 1 and session.branch_problem() is None:
        for start in range(0, len(suffixes), batch):
            part = [list(s) for s in suffixes[start:start + batch]]
            with Branches(session, len(part)) as branches:
                out += branches.greedy(branches.extend(part), max_new_tokens, eos_token_id)
        return out
    mark = session.mark()
    device = session.state.key_positions.device
    for suffix in suffixes:
        logits = session.extend(torch.tensor([list(suffix)], dtype=torch.long, device=device))[:, -1]
        out.append(session.greedy(logits, max_new_tokens, eos_token_id).tokens[0].tolist())
        session.rollback(mark)
    return out
