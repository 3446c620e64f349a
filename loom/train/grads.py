"""Gradient arithmetic across shards and ranks: global norm, clipping, finiteness, unscaling.

Gradients are plain tensors (data parallel: the same on every rank after synchronisation) or DTensors
(semi-auto: each rank holds shards). A rank's share of a global sum counts each element once: an element
replicated over k ranks contributes 1/k from each of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local_and_copies(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local values of `grad` and how many ranks hold each of them."""
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        copies = 1
        for axis, placement in enumerate(grad.placements):
            assert not placement.is_partial(), "gradients are synchronised before they are measured"
            if isinstance(placement, Replicate):
                copies *= mesh.size(axis)
        return grad.to_local(), copies
    return grad, dist.get_world_size() if dist.is_initialized() else 1


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, as `clip_grad_norm_` computes it on one device (fp32)."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in _grads(params):
        local, copies = _local_and_copies(grad)
        total += local.detach().double().pow(2).sum() / copies
    if dist.is_initialized():
        dist.all_reduce(total)
    return total.sqrt().float()


def clip_grads_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale every gradient so that their global norm is at most `max_norm`; returns the norm before."""
    norm = global_grad_norm(params)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scale_grads_(params, coefficient.item())
    return norm


def scale_grads_(params: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by `factor` in place (shards in place for DTensors)."""
    if factor == 1.0:
        return
    for grad in _grads(params):
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor)


def all_finite(params: Iterable[torch.Tensor]) -> bool:
    """True when no gradient on any rank holds an inf or a NaN (every rank gets the same answer)."""
    bad = torch.zeros((), dtype=torch.float32)
    for grad in _grads(params):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not torch.isfinite(local).all():
            bad.fill_(1.0)
            break
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0
