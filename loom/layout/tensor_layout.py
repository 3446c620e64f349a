"""`TensorLayout`: how one global tensor is cut over the canonical mesh, and its DTensor placements."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard


@dataclass(frozen=True)
class TensorLayout:
    """For each tensor dim, the canonical mesh dims that cut it, outer to inner.

    `TensorLayout(((0, 1), ()))` on a 2 x 2 canonical mesh cuts dim 0 into 4 (mesh dim 0 outer, 1 inner) and
    leaves dim 1 whole: DTensor placements `(Shard(0), Shard(0))`. Mesh dims that cut no dim replicate the
    tensor (MindSpore's repeated computation). `partial` lists mesh dims over which the tensor is a pending sum
    (only operator outputs are partial, e.g. a matmul whose contracted dim is cut).
    """

    dim_axes: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        used = [axis for axes in self.dim_axes for axis in axes] + list(self.partial)
        assert len(used) == len(set(used)), f"a mesh dim cuts a tensor at most once: {self}"
        for axes in self.dim_axes:
            # DTensor nests several mesh dims on one tensor dim from the leftmost mesh dim outward.
            assert list(axes) == sorted(axes), f"mesh dims of one tensor dim must ascend: {self}"

    @property
    def ndim(self) -> int:
        return len(self.dim_axes)

    def placements(self, mesh_ndim: int) -> tuple[Placement, ...]:
        """DTensor placements, one per canonical mesh dim."""
        placements: list[Placement] = [Replicate()] * mesh_ndim
        for dim, axes in enumerate(self.dim_axes):
            for axis in axes:
                placements[axis] = Shard(dim)
        for axis in self.partial:
            placements[axis] = Partial()
        return tuple(placements)

    @classmethod
    def from_placements(cls, placements: Sequence[Placement], ndim: int) -> TensorLayout:
        """The layout a DTensor with these placements has (Shard on several mesh dims nests left to right)."""
        dim_axes: list[list[int]] = [[] for _ in range(ndim)]
        partial = []
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard):
                dim_axes[placement.dim % ndim].append(axis)
            elif isinstance(placement, Partial):
                partial.append(axis)
            elif not isinstance(placement, Replicate):
                raise ValueError(f"unsupported placement {placement} on mesh dim {axis}")
        return cls(tuple(tuple(a) for a in dim_axes), tuple(partial))

    @classmethod
    def replicated(cls, ndim: int) -> TensorLayout:
        return cls(((),) * ndim)

    def cuts(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """How many parts each tensor dim is cut into (a MindSpore strategy entry)."""
        return tuple(math.prod(mesh_shape[a] for a in axes) for axes in self.dim_axes)

    def describe(self, mesh_names: Sequence[str], mesh_shape: Sequence[int]) -> str:
        """Human-readable: cuts per dim and the mesh dims that cut them, e.g. `(4, 1) [dp_0+dp_1, -]`."""
        axes = ", ".join("+".join(mesh_names[a] for a in dim) if dim else "-" for dim in self.dim_axes)
        text = f"{self.cuts(mesh_shape)} [{axes}]"
        if self.partial:
            text += " partial(" + "+".join(mesh_names[a] for a in self.partial) + ")"
        return text


class ArrangementError(ValueError):
    """A device arrangement that cannot be placed on the canonical mesh."""


def align_device_matrix(
    device_matrix: Sequence[int], canonical_shape: Sequence[int]
) -> list[tuple[int, ...]]:
    """Map each axis of a row-major device matrix to the consecutive canonical mesh dims it spans.

    The device matrix and the canonical mesh number the same ranks row-major, so an axis of the matrix is a
    run of canonical dims exactly when the running products of both agree there.
    """
    groups: list[tuple[int, ...]] = []
    position = 0
    for size in device_matrix:
        dims: list[int] = []
        product = 1
        while product < size and position < len(canonical_shape):
            product *= canonical_shape[position]
            dims.append(position)
            position += 1
        if product != size:
            raise ArrangementError(
                f"device arrangement {tuple(device_matrix)} does not fit the canonical mesh "
                f"{' x '.join(map(str, canonical_shape))}: loom places every arrangement on that one mesh, so "
                f"each factor, outermost first, must be a product of consecutive canonical sizes (the factor "
                f"{size} is not). With a device count of distinct primes this is a limit of loom: choose cuts "
                f"whose factors follow the canonical order, or order the mesh axes (loom.init) to match them"
            )
        groups.append(tuple(dims))
    return groups
