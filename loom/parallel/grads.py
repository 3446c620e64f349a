"""Gradient arithmetic across shards and ranks: global norm, clipping, finiteness, unscaling.

Gradients are plain tensors (data parallel: the same on every rank after synchronisation), DTensors
(semi-auto: each rank holds shards) or chunks of reduce-scattered buckets (optimizer level 2). Each is seen
as a `GradView`: a rank's share of a global sum counts each element once, so an element held by k ranks
contributes 1/k from each of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


@dataclass(frozen=True)
class GradView:
    """A rank's piece of a gradient and how many ranks hold the same values."""

    local: torch.Tensor
    copies: int


def grad_views(params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[GradView]:
    """The gradients of `params` as this rank holds them (plain gradients are the same on every rank of
    `group`, by default the world)."""
    views = []
    world = _size(group)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if not isinstance(grad, DTensor):
            views.append(GradView(grad, world))
            continue
        copies = 1
        for axis, placement in enumerate(grad.placements):
            assert not placement.is_partial(), "gradients are synchronised before they are measured"
            if isinstance(placement, Replicate):
                copies *= grad.device_mesh.size(axis)
        views.append(GradView(grad.to_local(), copies))
    return views


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def global_grad_norm(
    views: Iterable[GradView],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The 2-norm of all gradients together, as `clip_grad_norm_` computes it on one device (fp32), over
    the ranks of `group` (default: the world; a replica's own ranks when replicas step alone). It stays on
    the gradients' device: no host synchronisation. `device`: where the norm lives when this rank holds no
    gradient (default: the CPU); a rank with none still joins the all-reduce, which NCCL takes on a GPU
    tensor only."""
    views = list(views)
    device = views[0].local.device if views else torch.device(device or "cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for view in views:
        by_copies.setdefault(view.copies, []).append(view.local.detach())
    for copies, tensors in by_copies.items():  # one fused kernel per group rather than one per gradient
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
        total += torch.stack(norms).pow(2).sum() / copies
    if _size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt().float()


def clip_grads_(views: list[GradView], max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Scale every gradient so that their global norm is at most `max_norm`; returns the norm before
    (`norm`: that norm when the caller has it already, saving a collective). The coefficient stays on the
    device (no host synchronisation); a non-finite norm makes every gradient non-finite."""
    norm = global_grad_norm(views) if norm is None else norm
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    tensors = [view.local for view in views]
    if tensors:
        torch._foreach_mul_(tensors, coefficient.to(tensors[0].device))
    return norm


def scale_grads_(views: Iterable[GradView], factor: float) -> None:
    """Multiply every gradient by `factor` in place."""
    if factor != 1.0:
        for view in views:
            view.local.mul_(factor)


def any_nonfinite(views: Iterable[GradView], device: torch.device | str | None = None) -> torch.Tensor:
    """1.0 when a gradient this rank holds has an inf or a NaN, else 0.0: a float32 tensor on the
    gradients' device (on `device`, default the CPU, when it holds none), computed without a host
    synchronisation."""
    flags = [torch.isfinite(view.local).all().logical_not() for view in views]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device or "cpu")
    return torch.stack(flags).any().float()


def all_finite(
    views: Iterable[GradView],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> bool:
    """True when no gradient on any rank of `group` (default: the world) holds an inf or a NaN (every rank
    gets the same answer; one host synchronisation, for the answer). `device`: as `any_nonfinite`'s."""
    bad = any_nonfinite(views, device)
    if _size(group) > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bad.item() == 0.0
