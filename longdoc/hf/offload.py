"""Layer checkpoints in host memory: each checkpointed decoder layer's inputs move to (pinned) host memory in the
forward and come back for that layer's recompute, the layer below prefetched one layer ahead on a side stream so
the copies overlap compute. The arithmetic is unchanged: the recompute reads a bitwise copy of its input.

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    offloader = offload_checkpoints(model)       # after checkpointing is on (and after LoRA / before FSDP is fine)
    offloader.stats                              # tensors and bytes moved, restores, prefetch hits

How: transformers checkpoints a decoder layer by calling the layer's `_gradient_checkpointing_func(forward, *args)`;
torch's checkpoint (reentrant or not) stores `args` as saved tensors packed by the saved-tensor hooks active around
the call (inside the checkpoint its own hooks win, so nothing else in the layer is touched). We wrap that function
per layer with hooks that copy the inputs to host memory. On CPU the same hooks run with host = device: the input is
copied to a separate CPU tensor and the recompute reads that copy (streams and pinning are CUDA-only).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class OffloadStats:
    moved: int = 0  # tensors copied to host in forwards
    moved_bytes: int = 0
    restored: int = 0  # tensors handed back for a recompute
    prefetch_hits: int = 0  # of those, already fetched one layer ahead


class _Entry:
    """One saved checkpoint input: its host copy, and a device copy fetched ahead of its recompute (CUDA)."""

    __slots__ = ("__weakref__", "device", "event", "host", "ordinal", "prefetched", "prefetch_event", "prev")

    def __init__(self, host: torch.Tensor, device: torch.device, ordinal: int, prev, event=None):
        self.host, self.device, self.ordinal, self.prev, self.event = host, device, ordinal, prev, event
        self.prefetched: torch.Tensor | None = None
        self.prefetch_event = None


class CheckpointOffloader:
    """The hooks and their bookkeeping for one model; `pin_memory` applies to CUDA inputs only."""

    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory
        self.stats = OffloadStats()
        self._streams: dict[torch.device, Any] = {}
        self._last: weakref.ref | None = None  # the entry packed last: the layer below the next one
        self._live: weakref.WeakSet = weakref.WeakSet()

    def host_bytes(self) -> int:
        """Bytes of checkpoint inputs held in host memory now (entries still referenced by an autograd graph)."""
        return sum(e.host.untyped_storage().nbytes() for e in list(self._live))

    def live_entries(self) -> list[_Entry]:
        return list(self._live)

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor, ordinal: int) -> _Entry:
        last = self._last() if self._last is not None else None
        # the layer below this one in the same forward; a new forward starts again at a lower ordinal
        prev = weakref.ref(last) if last is not None and last.ordinal < ordinal else None
        if t.is_cuda:
            stream = self._stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is complete before it is copied
            with torch.cuda.stream(stream):
                host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory)
                host.copy_(t.detach(), non_blocking=True)
                event = stream.record_event()
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done, not longer
        else:
            host = torch.empty_like(t, device="cpu")
            host.copy_(t.detach())
            event = None
        entry = _Entry(host, t.device, ordinal, prev, event)
        self._last = weakref.ref(entry)
        self._live.add(entry)
        self.stats.moved += 1
        self.stats.moved_bytes += host.untyped_storage().nbytes()
        return entry

    def unpack(self, entry: _Entry) -> torch.Tensor:
        self.stats.restored += 1
        if entry.prefetched is not None:
            self.stats.prefetch_hits += 1
            x, event = entry.prefetched, entry.prefetch_event
            entry.prefetched = entry.prefetch_event = None
            if event is not None:
                current = torch.cuda.current_stream(entry.device)
                current.wait_event(event)
                x.record_stream(current)  # allocated on the side stream, used and freed on this one
        else:
            x = self._fetch_now(entry)
        below = entry.prev() if entry.prev is not None else None
        if below is not None and below.prefetched is None:
            self._prefetch(below)
        return x

    def _fetch_now(self, entry: _Entry) -> torch.Tensor:
        if entry.device.type != "cuda":
            return entry.host if entry.device.type == "cpu" else entry.host.to(entry.device)
        current = torch.cuda.current_stream(entry.device)
        current.wait_event(entry.event)  # the host copy is complete
        return entry.host.to(entry.device, non_blocking=self.pin_memory)

    def _prefetch(self, entry: _Entry) -> None:
        if entry.device.type != "cuda":
            entry.prefetched = self._fetch_now(entry)  # no copy to overlap: the same hand-back, counted as ahead
            return
        stream = self._stream(entry.device)
        with torch.cuda.stream(stream):
            stream.wait_event(entry.event)
            entry.prefetched = entry.host.to(entry.device, non_blocking=self.pin_memory)
            entry.prefetch_event = stream.record_event()


class _OffloadedCheckpoint:
    """A layer's checkpoint function, run with the offloading hooks around it (picklable, one per layer)."""

    def __init__(self, offloader: CheckpointOffloader, ordinal: int, inner: Callable):
        self.offloader, self.ordinal, self.inner = offloader, ordinal, inner

    def __call__(self, function, *args, **kwargs):
        off, ordinal = self.offloader, self.ordinal
        with torch.autograd.graph.saved_tensors_hooks(lambda t: off.pack(t, ordinal), off.unpack):
            return self.inner(function, *args, **kwargs)


def _layers(model) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def offload_checkpoints(model, pin_memory: bool = True) -> CheckpointOffloader:
    """Offload the inputs of every checkpointed decoder layer of `model` to host memory (see the module docstring).

    Call after `activation_checkpointing_enable`; raises ValueError when no layer of `model` is checkpointed.
    Calling it again returns the offloader already installed.
    """
    layers = [m for m in _layers(model) if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise ValueError(f"offload_checkpoints: no decoder layer of {type(model).__name__} is checkpointed; call "
                         f"model.activation_checkpointing_enable() first (recipe: train.activation_checkpointing=true)")
    installed = {type(m._gradient_checkpointing_func) for m in layers}
    if installed == {_OffloadedCheckpoint}:
        return layers[0]._gradient_checkpointing_func.offloader
    offloader = CheckpointOffloader(pin_memory=pin_memory)
    for ordinal, layer in enumerate(layers):
        func = layer._gradient_checkpointing_func
        inner = func.inner if isinstance(func, _OffloadedCheckpoint) else func
        layer._gradient_checkpointing_func = _OffloadedCheckpoint(offloader, ordinal, inner)
    return offloader
