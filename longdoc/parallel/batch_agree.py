"""Content agreement for `shard_batch`: the ranks of a CP group check, in one tiny all-gather, that they
hold the SAME full batch (shapes, dtypes, an exact 64-bit checksum of every field, and the options).

Ranks reading different sequences of one shape would otherwise train on a loss that belongs to no
document, silently (transformers.Trainer's per-rank sampler does exactly that).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from longdoc.parallel import comm

# The fields whose content the CP ranks must agree on, in the order they are packed for the check.
_AGREED = ("inputs", "labels", "attention_mask", "position_ids")
_SAME_DATA_FIX = ("the ranks of a CP group must read the same sequences: sample per data-parallel replica, not "
                  "per rank (e.g. DistributedSampler(num_replicas=dp_size, rank=dp_rank), so that every CP rank "
                  "of one replica reads the same batch); ContextParallel(check_agreement=False) skips this check")


class CPInputError(ValueError):
    """Inputs a patched model cannot run exactly under CP (build them with cp.shard_batch)."""


# ---- content agreement ----

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DTYPE_CODES = {dt: i for i, dt in enumerate((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                                                torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                                torch.float64))}


def checksum(t: torch.Tensor) -> int:
    """An exact 64-bit fingerprint of a tensor's values (bit patterns, so -0.0 != 0.0 and NaNs count).

    sum_i bits_i * w_i in wrapping int64 arithmetic, with odd pseudo-random weights w_i (a splitmix64-style
    mix of the index): any one changed element always changes the sum (an odd weight is invertible modulo
    2**64), and reordered or several changed elements collide with probability ~2**-64. One multiply-add
    per element: microseconds for token ids, far below a training step even for inputs_embeds.
    """
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    bits = t.contiguous().view(_INT_OF_SIZE[t.element_size()]).reshape(-1).to(torch.int64)
    w = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device)
    w = w * -7046029254386353131 + 1442695040888963407  # 0x9E3779B97F4A7C15 as a signed int64; wraps
    w = w ^ (w >> 29)
    w = w * -4658895280553007687  # 0xBF58476D1CE4E5B9
    w = (w ^ (w >> 32)) | 1
    return int((bits * w).sum())


class _FieldMeta(NamedTuple):
    """One field's metadata as the ranks exchange it (packs to ints for comm.agree)."""

    present: int
    shape: tuple[int, int, int]  # (batch, seq, hidden or 0)
    dtype: int
    checksum: int

    @classmethod
    def of(cls, t: torch.Tensor | None) -> _FieldMeta:
        if t is None:
            return cls(0, (0, 0, 0), -1, 0)
        shape = (tuple(t.shape) + (0, 0, 0))[:3]
        return cls(1, shape, _DTYPE_CODES.get(t.dtype, -2), checksum(t))

    def pack(self) -> list[int]:
        return [self.present, *self.shape, self.dtype, self.checksum]


_FIELD_INTS = 6


class _BatchMeta(NamedTuple):
    """What the CP ranks agree on before sharding: a validity flag, every field, and the options."""

    valid: int
    fields: tuple[_FieldMeta, ...]  # in _AGREED order
    options: tuple[int, int, int]  # pad_token_id, ignore_index, num_items_in_batch (-1 = counted)

    def pack(self) -> list[int]:
        return [self.valid, *(i for f in self.fields for i in f.pack()), *self.options]

    @classmethod
    def unpack(cls, ints: list[int]) -> _BatchMeta:
        fields = []
        for j in range(len(_AGREED)):
            p, b, s, h, dt, cs = ints[1 + j * _FIELD_INTS: 1 + (j + 1) * _FIELD_INTS]
            fields.append(_FieldMeta(p, (b, s, h), dt, cs))
        return cls(ints[0], tuple(fields), tuple(ints[-3:]))


def _field_name(j: int, fields_key: str | None) -> str:
    return (fields_key or "input_ids/inputs_embeds") if _AGREED[j] == "inputs" else _AGREED[j]


def agree_content(fields: dict[str, Any] | None, cp, pad_token_id: int, ignore_index: int,
                  num_items_in_batch) -> None:
    """One all-gather of every rank's _BatchMeta; raises the same CPInputError on every rank when they differ.

    `fields` None: this rank's batch failed validation (it raises its own error; the others learn it here).
    """
    options = (int(pad_token_id), int(ignore_index), -1 if num_items_in_batch is None else int(num_items_in_batch))
    if fields is None:
        mine = _BatchMeta(0, tuple(_FieldMeta.of(None) for _ in _AGREED), options)
    else:
        mine = _BatchMeta(1, tuple(_FieldMeta.of(fields[name]) for name in _AGREED), options)
    device = cp.comm_device(fields["inputs"].device) if fields is not None else cp.comm_device(torch.device("cpu"))
    metas = [_BatchMeta.unpack(m) for m in comm.agree(mine.pack(), cp.group, cp.timeout, device,
                                                      getattr(cp, "guard", None), "agree batch content")]
    if fields is None:
        return  # the caller re-raises this rank's own validation error
    key = fields["key"]
    invalid = [r for r, m in enumerate(metas) if not m.valid]
    if invalid:
        raise CPInputError(f"cp.shard_batch: CP rank {invalid[0]} rejected its batch (its error says why), so the "
                           f"CP ranks do not hold the same batch; {_SAME_DATA_FIX}")
    differ = [_field_name(j, key) for j in range(len(_AGREED)) if len({m.fields[j] for m in metas}) > 1]
    if len({m.options for m in metas}) > 1:
        differ.append("the shard_batch options (pad_token_id, ignore_index, num_items_in_batch)")
    if not differ:
        return
    ranks = [r for r, m in enumerate(metas) if m != metas[0]]
    shapes = ""
    for j in range(len(_AGREED)):
        if len({(m.fields[j].present, m.fields[j].shape, m.fields[j].dtype) for m in metas}) > 1:
            per_rank = ", ".join(f"rank {r}: {_describe(m.fields[j])}" for r, m in enumerate(metas))
            shapes += f"; {_field_name(j, key)} {per_rank}"
    raise CPInputError(f"cp.shard_batch: the CP ranks hold different batches: {', '.join(differ)} "
                       f"differ{'s' if len(differ) == 1 else ''} between rank 0 and rank(s) {ranks}{shapes}; "
                       f"{_SAME_DATA_FIX}")


def _describe(f: _FieldMeta) -> str:
    if not f.present:
        return "absent"
    names = {i: str(dt).removeprefix("torch.") for dt, i in _DTYPE_CODES.items()}
    shape = f.shape if f.shape[2] else f.shape[:2]
    return f"{tuple(shape)} {names.get(f.dtype, 'other dtype')}"
