"""The contract between the state-passing driver and one recurrence (see the package docstring)."""

from __future__ import annotations

from typing import Protocol

import torch

State = tuple[torch.Tensor, ...]  # a recurrent state: batch-first tensors (one or more)
Summary = tuple[torch.Tensor, ...]  # a piece's summary: tensors whose shapes do not depend on its length


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype summaries and corrections accumulate in: fp32 for the low-precision dtypes, float64 kept, so a
    piece's output is rounded once to the model's dtype, as one process's kernel rounds it."""
    return torch.promote_types(dtype, torch.float32)


def acc(t: torch.Tensor) -> torch.Tensor:
    """`t` in its accumulation dtype (acc_dtype)."""
    return t.to(acc_dtype(t.dtype))


class Recurrence(Protocol):
    """One recurrent layer's maths on pieces (consecutive tokens of one document). All tensors batch first."""

    def local(self, piece: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, Summary]:
        """Run the piece from the zero state: (its output y0, its summary), optionally a third item, a carry
        that `finish` gets back (e.g. what the correction reuses). y0 may be None when the recurrence's finish
        computes every output itself (then finish also runs for pieces entered with the zero state, None)."""
        ...

    def advance(self, state: State | None, summary: Summary) -> State:
        """The state after a piece with this summary, entered with `state` (None: the zero state)."""
        ...

    def finish(self, piece: tuple[torch.Tensor, ...], y0: torch.Tensor | None, state: State | None,
               carry=None) -> torch.Tensor:
        """The piece's output when it is entered with `state` (None only when local gave no y0): y0 corrected,
        or the piece re-run. `carry` is passed (as the fourth argument) only when local returned one."""
        ...
