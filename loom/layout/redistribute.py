"""Moving tensors between layouts on the canonical mesh (DTensor's redistribute does the collectives)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate

from loom.dist import _torch_private
from loom.dist.mesh import Mesh
from loom.layout.tensor_layout import TensorLayout


def layout_of(x: DTensor) -> TensorLayout:
    """The `TensorLayout` of a DTensor."""
    return TensorLayout.from_placements(x.placements, x.ndim)


def as_replicated(x: torch.Tensor, mesh: Mesh) -> DTensor:
    """A plain tensor taken as the same global tensor on every rank (its gradient comes back whole)."""
    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh.device_mesh, [Replicate()] * mesh.ndim, run_check=False)


def to_layout(x: torch.Tensor, layout: TensorLayout, mesh: Mesh, what: str = "tensor") -> DTensor:
    """`x` (a DTensor on `mesh`, or a plain global tensor) redistributed to `layout`, differentiably.

    DTensor merges collectives over consecutive mesh dims into one, since `Mesh` registers their flattened
    meshes; its backward is the transposed collective.
    """
    x = as_replicated(x, mesh)
    if x.device_mesh != mesh.device_mesh:
        raise ValueError(
            f"{what} is a DTensor on {x.device_mesh}, not on loom's mesh {mesh}; create it with loom "
            f"(loom.shard / loom.parallelize) or pass the plain global tensor"
        )
    placements = layout.placements(mesh.ndim)
    if tuple(x.placements) == placements:
        return x
    masked = [_masked(p) for p in x.placements]
    if any(masked) and any(
        not m and p != q for m, p, q in zip(masked, x.placements, placements, strict=True)
    ):
        # a masked pending sum (a vocabulary-cut embedding's) masks with this rank's own ids: when another
        # mesh dim moves too, it is summed first, on the pieces as they are; DTensor may otherwise move the
        # other dim first, and the mask no longer fits the piece
        summed = tuple(Replicate() if _masked(p) else p for p in x.placements)
        x = _GradInPlacements.apply(x.redistribute(mesh.device_mesh, summed))
    out = x.redistribute(mesh.device_mesh, placements)
    if any(p.is_partial() for p in x.placements):
        out = _GradInPlacements.apply(out)
    return out


def _masked(p: Placement) -> bool:
    """A masked pending sum: DTensor's vocabulary-cut embedding output (a `Partial` holding a mask)."""
    return _torch_private.is_masked_partial(p)


class _GradInPlacements(torch.autograd.Function):
    """Identity whose backward hands the gradient on in the forward output's placements.

    Used where the forward sums a pending sum (Megatron's all-reduce after a row-parallel matrix or a
    vocabulary-cut embedding). Its backward must give the input's pending placement from whatever the
    gradient arrives in: DTensor cannot reach the masked pending sum of an embedding from an ordinary one,
    and from a pending gradient it picks reduce-scatters and all-gathers. Bringing the gradient to the
    output's placements first is Megatron's conjugate: one all-reduce where the gradient is pending, none
    where it is whole. Other redistributions keep DTensor's direct backward (a pending sum to a cut is one
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> DTensor:  # noqa: ANN001
        ctx.mesh, ctx.placements = x.device_mesh, tuple(x.placements)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole global tensor on every rank, differentiably (a plain tensor is returned as it is).

    Like DTensor's `full_tensor`, the result of a replicated DTensor is its local tensor itself, not a copy:
    clone it to keep a snapshot of a parameter that training will update.
    """
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t
