"""MindSpore's `Layout(device_matrix, alias_name)`: tensor dims mapped to named device axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loom.layout.tensor_layout import ArrangementError, TensorLayout, align_device_matrix

NONE = "None"


@dataclass(frozen=True)
class Layout:
    """A device matrix with a name per axis; call it to map tensor dims to axes.

    >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    >>> x_layout = layout("dp", ("sp", "mp"), "None")   # dim 0 on dp, dim 1 on sp and mp, dim 2 whole

    The device matrix numbers the devices row-major (the last axis varies fastest) and its product must equal
    the device count. A dim on several axes is cut by their product, outer axis first.
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str]) -> None:
        device_matrix, alias_name = tuple(device_matrix), tuple(alias_name)
        if len(device_matrix) != len(alias_name):
            raise ValueError(
                f"Layout: device_matrix {device_matrix} has {len(device_matrix)} axes but alias_name "
                f"{alias_name} names {len(alias_name)}; give one name per axis"
            )
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in device_matrix):
            raise ValueError(
                f"Layout: device_matrix {device_matrix} must hold positive ints, one size per axis, "
                f"e.g. Layout((2, 2), ('dp', 'mp'))"
            )
        if any(not isinstance(n, str) for n in alias_name):
            raise ValueError(
                f"Layout: alias_name {alias_name} must hold axis names (strings), one per axis, "
                f"e.g. Layout((2, 2), ('dp', 'mp'))"
            )
        if len(set(alias_name)) != len(alias_name) or NONE in alias_name:
            raise ValueError(f"Layout: alias names {alias_name} must be distinct and not {NONE!r}")
        object.__setattr__(self, "device_matrix", device_matrix)
        object.__setattr__(self, "alias_name", alias_name)

    def __call__(self, *tensor_map: str | Sequence[str]) -> TensorMap:
        """Map each tensor dim to an axis name, a tuple of names, or `"None"` (not cut)."""
        dims: list[tuple[str, ...]] = []
        used: dict[str, int] = {}
        for dim, entry in enumerate(tensor_map):
            names = _axis_names(dim, entry, self.alias_name)
            names = tuple(n for n in names if n != NONE)
            for name in names:
                if name not in self.alias_name:
                    raise ValueError(
                        f"Layout: dim {dim} names the unknown axis {name!r}; "
                        f"the axes are {list(self.alias_name)} (or 'None' for a dim that is not cut)"
                    )
                if name in used:
                    raise ValueError(
                        f"Layout: axis {name!r} cuts dim {used[name]} and dim {dim}; an axis cuts a tensor at "
                        f"most once: map dim {dim} to another axis or to 'None'"
                    )
                used[name] = dim
            dims.append(names)
        return TensorMap(self, tuple(dims))

    def size(self, name: str) -> int:
        return self.device_matrix[self.alias_name.index(name)]


def _axis_names(dim: int, entry: object, alias_name: tuple[str, ...]) -> tuple[str, ...]:
    """The axis names of one dim's entry: a name, a tuple of names, or "None" (not cut)."""
    example = f"layout({alias_name[0]!r}, {NONE!r})" if alias_name else f"layout({NONE!r})"
    if entry is None:
        raise ValueError(
            f"Layout: dim {dim} is Python None; write the string {NONE!r} for a dim that is not cut "
            f"(MindSpore's convention), e.g. {example}"
        )
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list) and all(isinstance(n, str) for n in entry):
        return tuple(entry)
    if isinstance(entry, int) and not isinstance(entry, bool):
        raise ValueError(
            f"Layout: dim {dim} is the int {entry}; a Layout maps each dim to axis names "
            f"{list(alias_name)} (or {NONE!r}), not to a cut: for cuts write a strategy tuple instead"
        )
    raise ValueError(
        f"Layout: dim {dim} is {entry!r}; give an axis name, a tuple of axis names, or {NONE!r}, "
        f"e.g. {example}"
    )


@dataclass(frozen=True)
class TensorMap:
    """A `Layout` applied to one tensor: the axis names of each dim."""

    layout: Layout
    dims: tuple[tuple[str, ...], ...]

    def cuts(self) -> tuple[int, ...]:
        return tuple(math.prod(self.layout.size(n) for n in names) for names in self.dims)

    def compile(
        self, op: str, name: str, shape: Sequence[int], canonical_shape: Sequence[int]
    ) -> TensorLayout:
        """The `TensorLayout` of input `name` (shape `shape`) on the canonical mesh."""
        layout = self.layout
        where = f"{op}: layout of input {name}"
        if len(self.dims) != len(shape):
            raise ValueError(
                f"{where} maps {len(self.dims)} dims but {name} has {len(shape)} (shape {tuple(shape)}); "
                f"give one entry per dim"
            )
        world = math.prod(canonical_shape)
        if math.prod(layout.device_matrix) != world:
            raise ValueError(
                f"{where}: device_matrix {layout.device_matrix} has {math.prod(layout.device_matrix)} devices "
                f"but there are {world}; make its product {world}"
            )
        for dim, (cut, size) in enumerate(zip(self.cuts(), shape, strict=True)):
            if size % cut:
                raise ValueError(
                    f"{where}: dim {dim} has size {size}, which its axes {self.dims[dim]} (cut {cut}) do not "
                    f"divide; uneven cuts are not supported: choose axes whose sizes multiply to a divisor"
                )
        try:
            groups = dict(
                zip(
                    layout.alias_name, align_device_matrix(layout.device_matrix, canonical_shape), strict=True
                )
            )
        except ArrangementError as error:
            raise ValueError(f"{where}: {error}") from None
        dim_axes = []
        for dim, names in enumerate(self.dims):
            order = [layout.alias_name.index(n) for n in names]
            if order != sorted(order):
                raise ValueError(
                    f"{where}: dim {dim} lists axes {names} out of device-matrix order; loom cuts a dim over "
                    f"several axes outer axis first: write them in the order of alias_name {layout.alias_name}"
                )
            dim_axes.append(tuple(axis for n in names for axis in groups[n]))
        return TensorLayout(tuple(dim_axes))


def on_mesh_axes(entry: object, axis_sizes: Sequence[tuple[str, int]], ep: int = 1) -> object:
    """A strategy entry as `compile_inputs` takes it: cuts per dim (`(2, 1)`) and None stay as they are;
    mesh axis names per dim (`("tp", "None")`, a tuple of names to cut a dim along several axes) become a
    `Layout` map over the mesh's axes (`axis_sizes`: (name, size), outermost first). A name the mesh lacks
    means "not cut", so one plan serves meshes with and without that axis.

    `ep > 1` names the innermost `ep` ranks of the "dp" axis "ep" (expert parallelism lives inside data
    parallelism): an entry's "ep" cuts over them alone, its "dp" over the whole axis still. With `ep = 1`
    "ep" is not cut."""
    if not isinstance(entry, tuple | list) or not any(isinstance(e, str | tuple | list) for e in entry):
        return entry
    axis_sizes, aliases = _split_expert_axis(tuple(axis_sizes), ep)
    names = tuple(name for name, _ in axis_sizes)
    layout = Layout(tuple(size for _, size in axis_sizes), names)

    def kept(dim: object) -> object:
        wanted = dim if isinstance(dim, tuple | list) else (dim,)
        present = tuple(axis for name in wanted for axis in aliases.get(name, (name,)) if axis in names)
        return present if present else NONE

    return layout(*(kept(dim) for dim in entry))


def _split_expert_axis(
    axis_sizes: tuple[tuple[str, int], ...], ep: int
) -> tuple[tuple[tuple[str, int], ...], dict[str, tuple[str, ...]]]:
    """The axes with "dp" cut into ("dp", dp / ep) and ("ep", ep), and "dp" as the alias of both."""
    if ep == 1:
        return axis_sizes, {}
    sizes = dict(axis_sizes)
    if sizes.get("dp", 1) % ep:
        raise ValueError(
            f"ep = {ep}: expert parallelism cuts the mesh's 'dp' axis, of size {sizes.get('dp', 1)}; choose an "
            f"ep that divides it"
        )
    at = [name for name, _ in axis_sizes].index("dp")
    split = (("dp", sizes["dp"] // ep), ("ep", ep))
    return axis_sizes[:at] + split + axis_sizes[at + 1 :], {"dp": ("dp", "ep")}
