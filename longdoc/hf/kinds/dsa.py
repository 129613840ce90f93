"""DeepSeek sparse attention (DSA): the lightning indexer's top-k over the WHOLE sequence under CP.

An indexer scores every query against every earlier index key (one small head per token) and keeps the top-k
keys; the layer's attention then sees only those. HF's indexer returns the top-k as int32 key indices (B, S, k)
and passes them to the attention function as `indices=` (the eager / sdpa paths turn them into a mask).

Under CP the indexer module's OWN forward runs, unchanged, on what it would see in one process:
  1. keys: it runs once on this rank's tokens with a stand-in cache that records the index keys it computes
     (and hands back none, so it scores nothing); the keys are all-gathered into global order (B, T, D);
  2. scores and top-k: it runs again per tile of this rank's queries (contiguous global positions, at most
     SCORE_ELEMENTS scores per tile) with a stand-in cache that hands back the global keys up to the tile's last
     query and a causal mask; its top-k is then run (`_FullRow`) on that row padded with -inf to the row's
     full length T, which is one process's row value for value (its mask puts -inf at every later key). So
     even exact ties are broken as one process breaks them: torch.topk's order on a tie is a function of the
     whole row, its length included (CPU: introselect), which a merge of per-block top-ks could not
     reproduce. The indices it returns are global key positions.
  On CUDA the stable rule replaces step 2's bitwise argument (a GEMM picks its algorithm by shape, so a tile's
  fp32 score may differ from one process's in the last bit): the score products run in float64 and ties go to
  the lower global key index (`stable_topk`), at every tile shape and in longdoc's one-process path alike. The
  guarantee, per device, is stated in docs/concepts.md (Selected-key attention).
The tiles bound memory at SCORE_ELEMENTS (one process builds (S x heads x T) scores at once); the compute per
query is the one process's. Packed rows: each document is its own row (what running it alone gives). The
indices go to the attention function as `indices=` and from there to the CP core as `selected=`
(longdoc.parallel.selection): attention over the selected keys wherever they live.

Rows have one process's length: a row's real length (cp.shard_batch passes it for padded batches:
handle.row_lengths; a KV session knows its prompt's), each document's for packed rows. A row padded to
cp.multiple would be a few -inf entries longer, which changes torch.topk's choice among keys whose scores are
EXACTLY equal at the k-th place about one time in four (tied scores are common: a key whose index score is 0
for every head). The same holds in one process: a DSA model's output for a token depends on how long the row
is (a batch's padding, or a prefill of the prompt alone vs one forward over prompt + answer).

KV session: prefill keeps this rank's index keys beside its K/V (longdoc.hf.decode.ShardedCache); extend
gathers every rank's index keys into global order for the new queries, and the rank that stores the new tokens
appends their index keys.

The indexer is decorated @torch.no_grad() in HF (its weights get no gradient from the selection); so here.
"""

from __future__ import annotations

import inspect

import torch
from torch.overrides import TorchFunctionMode

from longdoc.hf.kinds.registry import AttentionTweak, register
from longdoc.parallel import comm
from longdoc.parallel import layout as layouts

# The indexers whose forward is DeepSeek-V3.2's: keys via cache.update_indexer(k, layer_idx), scores of
# (B, S, T) masked by attention_mask (bool: hidden where False), then index_scores.topk(min(index_topk, T)).
INDEXERS = frozenset({"DeepseekV32Indexer", "GlmMoeDsaIndexer", "MistralLarge4TextIndexer", "HYV4Indexer",
                      "HYV4VLIndexer", "AXK2Indexer", "Dots3NoteTextIndexer"})
# per-head index scores per query tile: 16 MB in fp32 (32 MB as float64 on CUDA). The tile is a per-rank constant
# (its rows score every global key), so it is kept small beside what shrinks with cp (bench kinds: at 8k the
# 128 MB tile of 1 << 25 left a cp=2 rank at 0.76x the one-process peak)
SCORE_ELEMENTS = 1 << 22


class _Keys:
    """The indexer's cache for one call: records the index keys it computes and hands back `keys` (None: an
    empty key set, so the call scores nothing)."""

    def __init__(self, keys: torch.Tensor | None = None):
        self.keys, self.seen = keys, None

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.seen = key_states
        return key_states[:, :0] if self.keys is None else self.keys


def _bind(original, args, kwargs) -> dict:
    call = inspect.signature(original).bind(*args, **kwargs).arguments
    return {**call.pop("kwargs", {}), **call}


def _rows(call: dict, length: int, rows: slice) -> dict:
    """The call restricted to local tokens `rows`: every per-token argument (dim 1 of that length) sliced."""
    def cut(x):
        if torch.is_tensor(x) and x.dim() >= 2 and x.shape[1] == length:
            return x[:, rows]
        if isinstance(x, tuple) and x and all(torch.is_tensor(t) for t in x):
            return tuple(cut(t) for t in x)
        return x
    return {name: cut(value) for name, value in call.items()}


def _rows_batch(call: dict, batch: int, r: int) -> dict:
    """The call restricted to batch row r (every per-row argument: dim 0 of the batch size)."""
    def cut(x):
        if torch.is_tensor(x) and x.dim() >= 1 and x.shape[0] == batch:
            return x[r:r + 1]
        if isinstance(x, tuple) and x and all(torch.is_tensor(t) for t in x):
            return tuple(cut(t) for t in x)
        return x
    return {name: cut(value) for name, value in call.items()}


def _run(original, call: dict, mask: torch.Tensor, keys: torch.Tensor | None) -> tuple[torch.Tensor, _Keys]:
    cache = _Keys(keys)
    out = original(**{**call, "attention_mask": mask, "cache": cache})
    return out, cache


def _local_keys(original, call: dict) -> torch.Tensor:
    """This rank's index keys (B, L, D), computed by the indexer's own code (scoring nothing)."""
    hidden = call["hidden_states"]
    empty = torch.zeros(hidden.shape[0], hidden.shape[1], 0, dtype=torch.bool, device=hidden.device)
    _, cache = _run(original, call, empty, None)
    if cache.seen is None:
        raise RuntimeError(f"{type(original.__self__).__name__} did not read its index keys through "
                           f"cache.update_indexer; longdoc's DSA route does not know this indexer")
    return cache.seen


def _tile_rows(heads: int, batch: int, row_len: int) -> int:
    return max(1, SCORE_ELEMENTS // max(1, heads * batch * row_len))


def stable_rule(device: torch.device) -> bool:
    """Whether the indexer's selection on `device` follows the stable rule (float64 scores, ties to the lower key
    index: see the module docstring) rather than torch.topk on fp32 scores bitwise equal to one process's."""
    return device.type != "cpu"


def stable_topk(x: torch.Tensor, k: int) -> torch.return_types.topk:
    """The k largest along the last dim; among equal values the lower index first (a stable descending sort)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return torch.return_types.topk((values[..., :k], indices[..., :k]))


class _FullRow(TorchFunctionMode):
    """Inside the indexer: its top-k runs on the one-process row of `row_len` keys. It scored only the keys up to
    its last query (every later key is hidden from all its queries); the rest of the row is what one process's
    mask puts there, -inf, so the row torch.topk sees is one process's, value for value, and so is its choice.

    stable: the score products (the indexer's matmuls whose result has one column per key seen) run in float64
    and the top-k is `stable_topk`, so the choice no longer rests on the GEMM's shape (see the module docstring)."""

    def __init__(self, row_len: int, index_topk: int, stable: bool = False, seen: int = -1):
        super().__init__()
        self.row_len, self.k, self.stable, self.seen = row_len, min(index_topk, row_len), stable, seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.topk, torch.topk) and args[0].dim() == 3:
            x = args[0]
            if x.shape[-1] < self.row_len:
                x = torch.cat([x, x.new_full((*x.shape[:-1], self.row_len - x.shape[-1]), float("-inf"))], dim=-1)
            if self.stable:
                return stable_topk(x, self.k)
            if x is args[0]:
                return func(*args, **kwargs)
            kwargs.pop("k", None)
            return func(x, self.k, *args[2:], **kwargs)
        if (self.stable and func in (torch.matmul, torch.Tensor.matmul) and len(args) == 2
                and all(torch.is_tensor(t) and t.is_floating_point() and t.dim() >= 3 for t in args)
                and args[1].shape[-1] == self.seen):
            # fp32 x fp32 products are exact in float64: the accumulation order (which the GEMM picks by shape)
            # moves a score by ~1e-16 relative, not by fp32 ulps
            return func(args[0].double(), args[1].double(), **kwargs)
        return func(*args, **kwargs)


def _select(original, call: dict, keys: torch.Tensor, pieces, heads: int, width: int,
            index_topk: int, stable: bool | None = None) -> torch.Tensor:
    """(B, L, width) int32 global key indices. Each piece (local offset, global start, length, key offset, row
    length) is a run of this rank's queries whose one-process row is keys[:, key offset : key offset + row
    length]; the indexer scores and top-k's them itself (scoring only the keys up to each tile's last query:
    _FullRow). -1 pads rows narrower than width. stable: the rule (None: `stable_rule` of the device)."""
    hidden = call["hidden_states"]
    stable = stable_rule(hidden.device) if stable is None else stable
    b, length = hidden.shape[:2]
    out = torch.full((b, length, width), -1, dtype=torch.int32, device=hidden.device)
    for local, start, n, key_off, row_len in pieces:
        step = _tile_rows(heads, b, row_len)
        for a in range(0, n, step):
            r = min(step, n - a)
            first, last = start + a - key_off, start + a - key_off + r  # the tile's queries, in the row
            seen = min(row_len, last)  # keys any of them may see: [0, seen)
            i = torch.arange(first, last, device=hidden.device)
            j = torch.arange(seen, device=hidden.device)
            mask = (j[None, :] <= i[:, None]).unsqueeze(0).expand(b, -1, -1)  # (B, tile, seen): causal
            with _FullRow(row_len, index_topk, stable, seen):
                idx, _ = _run(original, _rows(call, length, slice(local + a, local + a + r)), mask,
                              keys[:, key_off:key_off + seen])
            idx = idx.to(torch.int32)
            out[:, local + a:local + a + r, :idx.shape[-1]] = torch.where(idx >= 0, idx + key_off, idx)
    return out


def _heads(module) -> int:
    return int(getattr(module, "n_heads", None) or getattr(module, "num_heads", None) or 64)


def _pieces(cp, seq_len: int, documents, row_len: int) -> list[tuple[int, int, int, int, int]]:
    """This rank's query runs as _select's pieces: rows of `row_len` keys from 0 for an unpacked sequence,
    each document's own row for a packed one."""
    runs = layouts.runs(cp.layout, cp.rank, cp.size, seq_len, documents)
    if documents is None:
        out, local = [], 0
        for start, n in runs:
            out.append((local, start, n, 0, row_len))
            local += n
        return out
    cuts = [*documents.starts(), seq_len]
    out, local = [], 0
    for start, n in runs:
        pos = start
        while pos < start + n:  # split at document starts (per-document zigzag pieces never cross one)
            d = max(k for k, c in enumerate(cuts) if c <= pos)
            stop = min(start + n, cuts[d + 1])
            out.append((local + pos - start, pos, stop - pos, cuts[d], cuts[d + 1] - cuts[d]))
            pos = stop
        local += n
    return out


def _gather(k: torch.Tensor, cp, documents) -> torch.Tensor:
    return k if cp.size == 1 else cp.gather(k.contiguous(), dim=1, documents=documents)


def _train(module, handle, original, call: dict, local_keys: torch.Tensor) -> torch.Tensor:
    """A patched forward or a session's prefill: this rank's queries against the whole sequence."""
    cp = handle.cp if handle.session is None else handle.session.cp
    b, length = call["hidden_states"].shape[:2]
    seq_len = length * cp.size
    heads = _heads(module)
    docs = handle.documents if handle.session is None else None
    if docs is None:
        # Rows end at their real length, like one process's (the padding after it is never a candidate of a
        # real query): cp.shard_batch tells a padded batch's lengths, a prefill knows its prompt's.
        if handle.session is not None:
            real = [handle.session.total] * b
        elif handle.row_lengths is not None:
            real = [max(1, int(n)) for n in handle.row_lengths.tolist()]
        else:
            real = [seq_len] * b
        keys = _gather(local_keys, cp, None)
        width = min(module.index_topk, max(real))
        if len(set(real)) == 1:
            return _select(original, call, keys, _pieces(cp, seq_len, None, real[0]), heads, width, module.index_topk)
        return torch.cat([_select(original, _rows_batch(call, b, r), keys[r:r + 1], _pieces(cp, seq_len, None, n),
                                  heads, width, module.index_topk) for r, n in enumerate(real)], dim=0)
    width = min(module.index_topk, seq_len)
    rows = []
    for r, d in enumerate(docs):  # each row's documents are zigzagged on their own
        keys = _gather(local_keys[r:r + 1], cp, d)
        rows.append(_select(original, _rows_batch(call, b, r), keys, _pieces(cp, seq_len, d, 0), heads, width,
                            module.index_topk))
    return torch.cat(rows, dim=0)


def _extend(module, handle, original, call: dict) -> torch.Tensor:
    """New tokens (replicated on every rank) against every rank's cached index keys plus their own."""
    session, cp = handle.session, handle.session.cp
    cache = call.get("cache")
    new_keys = _local_keys(original, call)  # (B, n, D), identical on every rank
    b, n = new_keys.shape[:2]
    total, start = session.total, session.total - n
    cached = cache.index_keys.get(module.layer_idx) if cache is not None else None
    if cached is None:
        cached = new_keys[:, :0]
    keys = new_keys.new_zeros((b, total, new_keys.shape[-1]))
    positions = session.rank_positions
    if cp.size > 1:
        most = max(p.numel() for p in positions)
        padded = torch.nn.functional.pad(cached, (0, 0, 0, most - cached.shape[1]))
        parts = comm.all_gather(padded, cp.group, cp.timeout)
    else:
        parts = [cached]
    for part, pos in zip(parts, positions):
        keys[:, pos.to(keys.device)] = part[:, :pos.numel()]
    keys[:, start:] = new_keys
    if session.appending:
        cache.index_keys[module.layer_idx] = torch.cat([cached, new_keys], dim=1)
    return _select(original, call, keys, [(0, start, n, 0, total)], _heads(module), min(module.index_topk, total),
                   module.index_topk)


def cp_forward(module, handle, original, *args, **kwargs) -> torch.Tensor:
    call = _bind(original, args, kwargs)
    with torch.no_grad():
        if handle.session is not None and handle.session.mode == "extend":
            return _extend(module, handle, original, call)
        local_keys = _local_keys(original, call)
        if handle.session is not None:  # prefill: keep this rank's index keys beside its K/V
            call["cache"].index_keys[module.layer_idx] = local_keys
        return _train(module, handle, original, call, local_keys)


def _problem(module, handle) -> tuple[str, str] | None:
    if not isinstance(getattr(module, "index_topk", None), int) or getattr(module, "layer_idx", None) is None:
        return (f"a sparse-attention indexer ({type(module).__name__}) without index_topk / layer_idx",
                "longdoc's DSA route reads both from the indexer; run this model without CP")
    return None


KIND = register(AttentionTweak(
    name="dsa_indexer",
    layer_types=frozenset({"indexed_attention"}),
    matches=lambda m: type(m).__name__ in INDEXERS,
    forward=cp_forward,  # the layer's attention then runs the selected keys through the "longdoc_cp" backend
    problem=_problem,
))
