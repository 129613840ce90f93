"""The one collective of state passing and of conv halos: a differentiable all-gather of small tensors.

Every rank contributes the same list of tensors (same shapes and dtypes); every rank gets all ranks' tensors,
stacked on a new leading rank dimension. Backward: the gradient of rank r's contribution is the sum over ranks
of their gradients for it (a reduce-scatter), so gradients of an entering state or a halo flow back to the
rank that produced it. `anchor` makes every rank's output depend on the gathered tensors, so that every rank
runs the backward collective even when none of its own tokens needed another rank's state (e.g. rank 0 of
the contiguous layout); otherwise the other ranks would wait on it forever.
"""

from __future__ import annotations

import torch

from longdoc.parallel import comm


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _split(flat: torch.Tensor, like: list[torch.Tensor], lead: tuple[int, ...]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[..., offset:offset + n].reshape(*lead, *t.shape).to(t.dtype))
        offset += n
    return out


def gather(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], cp) -> list[torch.Tensor]:
    """Every rank's `tensors`, each stacked over ranks: (world, *shape). Not differentiable (`all_gather` is); one
    collective (the tensors travel as one flat buffer of their widest dtype, so every dtype comes back exact)."""
    if cp.size == 1:
        return [t.unsqueeze(0) for t in tensors]
    flat = torch.stack(comm.all_gather(_flat(list(tensors), _widest(tensors)), cp.group, cp.timeout))
    return _split(flat, list(tensors), (cp.size,))


def scatter_grads(grads: list[torch.Tensor], like: list[torch.Tensor] | tuple[torch.Tensor, ...], cp
                  ) -> list[torch.Tensor]:
    """The reverse of `gather`: `grads` are gradients of gathered tensors, (world, *shape) each; returns this rank's
    gradient of each of its own tensors `like`, the sum over ranks (a reduce-scatter)."""
    if cp.size == 1:
        return [g[0] for g in grads]
    dtype = _widest(grads)
    flat = torch.cat([g.reshape(cp.size, -1).to(dtype) for g in grads], dim=1)  # (world, total)
    mine = comm.reduce_scatter(list(flat.contiguous().unbind(0)), cp.group, cp.timeout)
    return _split(mine, list(like), ())


def _widest(tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cp, flat):
        ctx.cp = cp
        return torch.stack(comm.all_gather(flat, cp.group, cp.timeout))

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        return None, comm.reduce_scatter(list(grad.contiguous().unbind(0)), cp.group, cp.timeout)


def all_gather(tensors: list[torch.Tensor], cp) -> list[torch.Tensor]:
    """Every rank's `tensors`, each stacked over ranks: (world, *shape). Differentiable; one collective
    (the tensors travel as one flat buffer of their widest dtype, so every dtype comes back exact)."""
    if cp.size == 1:
        return [t.unsqueeze(0) for t in tensors]
    gathered = _AllGather.apply(cp, _flat(tensors, _widest(tensors)))  # (world, total)
    return _split(gathered, tensors, (cp.size,))


class _Anchor(torch.autograd.Function):
    """A literal zero scalar whose backward hands zeros to `x`: adding it changes nothing, not even a NaN."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def anchor(y: torch.Tensor, gathered: list[torch.Tensor]) -> torch.Tensor:
    """`y`, made to depend (with a zero) on `gathered`, so backward reaches the all-gather on every rank."""
    needs = [g for g in gathered if g.requires_grad]
    if not needs or not torch.is_grad_enabled():
        return y
    return y + sum(_Anchor.apply(g) for g in needs).to(y.dtype)
