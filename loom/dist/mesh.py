"""The device mesh: named axes validated once, compiled onto one canonical mesh.

A user names the mesh axes (`{"dp": 2, "tp": 2}`). loom keeps, besides those names, a *canonical* mesh in
which every axis is cut into its prime factors (`dp` of 4 becomes two mesh dims of 2). Any device arrangement
that MindSpore-style strategies ask for (`(4, 1)` for one operator, `(2, 2)` for the next) is then a set of
consecutive canonical dims, so every layout of the same devices lives on one DTensor mesh and any two can be
redistributed. Every run of consecutive canonical dims is also flattened once, so that DTensor merges
collectives over several dims into one (one all-gather over 4 ranks, not two over 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loom.dist._torch_private import flatten_mesh_dims

AXIS_NAMES_HINT = 'e.g. {"dp": 2, "tp": 2}'


def prime_factors(n: int) -> tuple[int, ...]:
    """The prime factors of `n` in ascending order (`12 -> (2, 2, 3)`)."""
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return tuple(factors)


def is_inner_factor(part: int, whole: int) -> bool:
    """Whether `part` is a product of the last prime factors of `whole`: a run of the innermost canonical
    dims of a mesh axis of size `whole` (expert-parallel groups within "dp"; any divisor of a power of
    two)."""
    factors, inner = prime_factors(whole), prime_factors(part)
    return whole % part == 0 and inner == factors[len(factors) - len(inner) :]


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    """Validated sizes of named mesh axes (as torchtitan's ParallelDims): product check and `-1` fill."""

    sizes: tuple[tuple[str, int], ...]
    world_size: int

    def __post_init__(self) -> None:
        names = [name for name, _ in self.sizes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for name, size in self.sizes:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} must be an identifier, {AXIS_NAMES_HINT}")
            if size < 1:
                raise ValueError(
                    f"mesh axis {name!r} has size {size}; sizes are positive (or one -1 to fill)"
                )
        product = math.prod(size for _, size in self.sizes)
        if product != self.world_size:
            raise ValueError(
                f"mesh {dict(self.sizes)} has {product} devices but the world size is {self.world_size}; "
                f"make the axis sizes multiply to {self.world_size} (one axis may be -1 to fill in)"
            )

    @classmethod
    def from_dict(cls, sizes: dict[str, int] | None, world_size: int) -> MeshShape:
        """Validate a user's `{"axis": size}`; `None` puts every device on `"dp"`; one `-1` is filled in."""
        if sizes is None:
            return cls(sizes=(("dp", world_size),), world_size=world_size)
        if not isinstance(sizes, dict) or not sizes:
            raise ValueError(f"mesh must be a non-empty dict of axis sizes, {AXIS_NAMES_HINT}; got {sizes!r}")
        items = [(name, int(size)) for name, size in sizes.items()]
        fills = [name for name, size in items if size == -1]
        if len(fills) > 1:
            raise ValueError(f"mesh {sizes}: only one axis may be -1, got {fills}")
        if fills:
            known = math.prod(size for _, size in items if size != -1)
            if known < 1 or world_size % known:
                raise ValueError(
                    f"mesh {sizes}: the other axes multiply to {known}, which does not divide the world size "
                    f"{world_size}, so {fills[0]!r} cannot be filled in"
                )
            items = [(name, world_size // known if size == -1 else size) for name, size in items]
        return cls(sizes=tuple(items), world_size=world_size)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sizes)

    def size(self, name: str) -> int:
        """The size of axis `name` (a clear error for an unknown name)."""
        for axis, size in self.sizes:
            if axis == name:
                return size
        raise ValueError(f"unknown mesh axis {name!r}; this mesh has axes {list(self.names)}")

    @cached_property
    def canonical(self) -> tuple[tuple[str, int], ...]:
        """Canonical mesh dims: each named axis cut into its prime factors, names `tp` or `tp_0, tp_1`."""
        dims = []
        for name, size in self.sizes:
            factors = prime_factors(size)
            if len(factors) == 1:
                dims.append((name, size))
            else:
                dims.extend((f"{name}_{i}", f) for i, f in enumerate(factors))
        return tuple(dims)

    def canonical_dims_of(self, name: str) -> tuple[int, ...]:
        """The canonical mesh dims that make up named axis `name` (empty for an axis of size 1)."""
        self.size(name)
        start = 0
        for axis, size in self.sizes:
            count = len(prime_factors(size))
            if axis == name:
                return tuple(range(start, start + count))
            start += count
        raise AssertionError("unreachable")


@dataclass(eq=False, kw_only=True)
class Mesh:
    """A built mesh: the validated shape, the canonical DTensor `DeviceMesh` and its flattened sub-meshes."""

    shape: MeshShape
    device_mesh: DeviceMesh
    _sub_meshes: dict[tuple[int, ...], DeviceMesh] = field(default_factory=dict, repr=False)
    _without: dict[str, Mesh] = field(default_factory=dict, repr=False)
    _groups: dict[tuple, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)
    # a mesh cut out of another (`without`): the groups are the parent's, with the cut axis fixed
    _parent: Mesh | None = field(default=None, repr=False)

    def __deepcopy__(self, memo: dict) -> Mesh:
        # a mesh is a handle on process groups every rank built together: copies of a model (the dry run's
        # meta copy, a gathered whole model) share it
        return self

    @classmethod
    def build(cls, shape: MeshShape, device_type: str = "cpu") -> Mesh:
        """Create the canonical mesh (a collective call: every rank builds the same mesh together)."""
        canonical = shape.canonical or (("all", 1),)
        ranks = torch.arange(shape.world_size).reshape([size for _, size in canonical])
        device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(name for name, _ in canonical))
        mesh = cls(shape=shape, device_mesh=device_mesh)
        mesh._flatten_all_runs()
        return mesh

    def _flatten_all_runs(self) -> None:
        names = self.device_mesh.mesh_dim_names
        ndim = len(names)
        for start in range(ndim):
            self._sub_meshes[(start,)] = self.device_mesh[names[start]]
            for stop in range(start + 2, ndim + 1):
                run = names[start:stop]
                self._sub_meshes[tuple(range(start, stop))] = flatten_mesh_dims(
                    self.device_mesh, run, "+".join(run)
                )

    @property
    def ndim(self) -> int:
        """Number of canonical mesh dims."""
        return self.device_mesh.ndim

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        return tuple(self.device_mesh.shape)

    def sub_mesh(self, dims: tuple[int, ...]) -> DeviceMesh:
        """The 1-D mesh over consecutive canonical dims `dims` (flattened when there are several)."""
        if dims not in self._sub_meshes:
            raise ValueError(f"canonical mesh dims {dims} are not a run of consecutive dims of {self}")
        return self._sub_meshes[dims]

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """Canonical dims of the data-parallel axis `"dp"` (none without one): the batch is split over them,
        the other axes see the same data."""
        return self.shape.canonical_dims_of("dp") if "dp" in self.shape.names else ()

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (size of the `"dp"` axis, 1 without one)."""
        return self.shape.size("dp") if "dp" in self.shape.names else 1

    def dp_rank(self) -> int:
        """This rank's index along the `"dp"` axis (0 without one)."""
        if not self.batch_dims:
            return 0
        return self.sub_mesh(self.batch_dims).get_local_rank()

    def axis_sizes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of every named axis, outermost first."""
        return tuple((name, self.shape.size(name)) for name in self.shape.names)

    def axis_size(self, name: str) -> int:
        """The size of named axis `name` (1 for an axis the mesh does not have)."""
        return self.shape.size(name) if name in self.shape.names else 1

    def axis_rank(self, name: str) -> int:
        """This rank's index along named axis `name` (0 for an axis of size 1 or one the mesh lacks)."""
        if self.axis_size(name) == 1:
            return 0
        return self[name].get_local_rank()

    def axis_group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of the ranks that differ from this one only along named axis `name` (e.g. the
        pipeline of this rank for `"pp"`, its data-parallel replicas for `"dp"`); None for an axis of size 1
        or one the mesh lacks, where there is nobody to talk to."""
        if self.axis_size(name) == 1:
            return None
        return self[name].get_group()

    def without(self, axis: str) -> Mesh:
        """The mesh of the other named axes among the ranks that share this rank's index along `axis` (for
        `"pp"`: this pipeline stage's dp x tp mesh), so that collectives on it never cross `axis`.

        A slice of this mesh's DeviceMesh (DTensor still finds the flattened runs on the root mesh), built
        on first use by every rank together (flattening may create process groups), then cached. An axis of
        size 1 leaves the same devices (e.g. the one replica of `loom.train.replicas`'s "replica" axis).
        """
        if axis not in self._without:
            if axis not in self.shape.names:
                raise ValueError(f"unknown mesh axis {axis!r}; {self} has axes {list(self.shape.names)}")
            kept = tuple((name, size) for name, size in self.shape.sizes if name != axis)
            if not kept:
                raise ValueError(f"{self} has no axis besides {axis!r}: there is nothing left")
            shape = MeshShape(sizes=kept, world_size=self.world_size // self.axis_size(axis))
            names = self.device_mesh.mesh_dim_names
            dims = [names[d] for name, _ in kept for d in self.shape.canonical_dims_of(name)]
            if not dims:
                raise ValueError(f"{self} has no axis of size > 1 besides {axis!r}")
            device_mesh = self.device_mesh if self.axis_size(axis) == 1 else self.device_mesh[tuple(dims)]
            mesh = Mesh(shape=shape, device_mesh=device_mesh, _parent=self)
            if self.axis_size(axis) == 1:
                mesh._sub_meshes = self._sub_meshes  # the same canonical dims
            else:
                mesh._flatten_all_runs()
            self._without[axis] = mesh
        return self._without[axis]

    def group(self, vary: Mapping[str, Sequence[int] | None]) -> dist.ProcessGroup | None:
        """The process group of the ranks that share this rank's index along every named axis not in `vary`
        and, along each axis in `vary`, have one of the given indices (None: any). None when this rank's own
        index is not among them. E.g. `{"dp": None, "tp": None}`: the ranks of this pipeline rank (its stage
        mesh); `{"pp": (0, 3), "dp": None}`: the data-parallel replicas of the first and the last pipeline
        rank with this rank's tp index (those that hold a tied embedding's copies).

        Collective on first use: every rank creates every group of this kind, in one order (a process group
        is created by all ranks together); then cached. On a mesh cut out of another (`without`) they are the
        parent's groups, this rank's index along the cut axis fixed (the ranks here are the parent's)."""
        if self._parent is not None:
            return self._parent.group(vary)
        key = tuple(sorted((axis, None if idx is None else tuple(idx)) for axis, idx in vary.items()))
        if key not in self._groups:
            sizes = [size for _, size in self.shape.sizes]
            coords = torch.stack(torch.unravel_index(torch.arange(self.world_size), sizes), dim=-1)
            allowed = torch.ones_like(coords, dtype=torch.bool)
            for axis, indices in vary.items():
                column = self.shape.names.index(axis)
                if indices is not None:
                    allowed[:, column] = torch.isin(coords[:, column], torch.tensor(list(indices)))
            fixed = [i for i, name in enumerate(self.shape.names) if name not in vary]
            members = allowed.all(dim=-1)
            partition = sorted(
                {tuple(int(r) for r in torch.nonzero(members & (coords[:, fixed] == c[fixed]).all(-1)).flatten())
                 for c, member in zip(coords, members, strict=True) if member}
            )  # fmt: skip
            me, mine = dist.get_rank(), None
            for ranks in partition:
                created = dist.new_group(list(ranks))
                if me in ranks:
                    mine = created
            self._groups[key] = mine
        return self._groups[key]

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh of named axis `name` (`mesh["dp"]`), e.g. for its process group."""
        dims = self.shape.canonical_dims_of(name)
        if not dims:
            raise ValueError(f"mesh axis {name!r} has size 1 and no sub-mesh")
        return self.sub_mesh(dims)

    def __repr__(self) -> str:
        named = ", ".join(f"{n}={s}" for n, s in self.shape.sizes)
        canonical = " x ".join(str(s) for s in self.canonical_shape)
        return f"Mesh({named}; canonical {canonical})"
