"""Count the bytes this rank sends through torch.distributed while a block of code runs.

    with counted() as sent:
        out = longdoc.attention(q, k, v, cp, strategy="ulysses"); out.backward(dout)
    sent.bytes

The benchmark's "bytes moved per rank" and the check of longdoc.parallel.traffic's formulas. It wraps the
torch.distributed functions longdoc.parallel.comm calls (looked up at call time, so the wrappers see them)
for the duration of the block only, in this process only. What a rank sends: point-to-point sends, its share
of all-gathers ((P-1) x its tensor), all-to-all splits to the other ranks, reduce-scatter parts for the
others; all-reduces are modelled as a ring all-reduce (2 (P-1) / P of the buffer), as gloo's internals are
not observable here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Sent:
    bytes: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, what: str, n: float) -> None:
        self.bytes += n
        self.calls[what] = self.calls.get(what, 0) + 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def counted() -> Iterator[Sent]:
    sent = Sent()
    saved = {name: getattr(dist, name) for name in
             ("batch_isend_irecv", "all_gather", "all_reduce", "all_to_all_single", "reduce_scatter")}

    def batch_isend_irecv(ops):
        sent.add("send", sum(_nbytes(op.tensor) for op in ops if getattr(op.op, "__name__", "") == "isend"))
        return saved["batch_isend_irecv"](ops)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sent.add("all_gather", (len(tensor_list) - 1) * _nbytes(tensor))
        return saved["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        size = dist.get_world_size(group)
        sent.add("all_reduce", 2 * (size - 1) / size * _nbytes(tensor))
        return saved["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if input_split_sizes is None:
            elements = input.numel() * (size - 1) / size
        else:
            elements = sum(input_split_sizes) - input_split_sizes[me]
        sent.add("all_to_all", elements * input.element_size())
        return saved["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group,
                                          async_op=async_op)

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        me = dist.get_rank(group)
        sent.add("reduce_scatter", sum(_nbytes(t) for i, t in enumerate(input_list) if i != me))
        return saved["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)

    wrappers = {"batch_isend_irecv": batch_isend_irecv, "all_gather": all_gather, "all_reduce": all_reduce,
                "all_to_all_single": all_to_all_single, "reduce_scatter": reduce_scatter}
    try:
        for name, fn in wrappers.items():
            setattr(dist, name, fn)
        yield sent
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
