"""loom's MindSpore-style primitives: each computes what the unsharded operator computes, on any strategy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from loom.layout import TensorLayout, layout_of
from loom.layout.redistribute import to_layout
from loom.ops.primitive import Primitive

BATCH = "ABCDEFGH"  # labels of batch dims, aligned from the right as broadcasting aligns them
DIMS = "abcdefgh"


def _aligned(shapes: Sequence[torch.Size]) -> list[str]:
    """Labels for broadcasting inputs: dims aligned from the right share a label."""
    rank = max(len(s) for s in shapes)
    return [DIMS[rank - len(s) : rank] for s in shapes]


def _axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if axis is None or axis == ():
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axes))


class _Elementwise(Primitive):
    """Broadcasting element-wise operators: dims aligned from the right are cut alike."""

    input_names = ("x", "y")
    function = staticmethod(torch.add)

    def labels(self, shapes, *extra):
        return _aligned(shapes)

    def compute(self, x, y):
        return self.function(x, y)


class Add(_Elementwise):
    """`x + y` with broadcasting."""

    function = staticmethod(torch.add)


class Sub(_Elementwise):
    """`x - y` with broadcasting."""

    function = staticmethod(torch.sub)


class Mul(_Elementwise):
    """`x * y` with broadcasting."""

    function = staticmethod(torch.mul)


class Div(_Elementwise):
    """`x / y` with broadcasting."""

    function = staticmethod(torch.div)


class _Unary(Primitive):
    input_names = ("x",)

    def labels(self, shapes, *extra):
        return [DIMS[: len(shapes[0])]]


class Identity(_Unary):
    """Its input, laid out as its strategy says: a point where a network asks for a layout change (e.g. the
    residual stream entering sequence parallelism) without an operator to carry the strategy."""

    def compute(self, x):
        return x


class ReLU(_Unary):
    """`max(x, 0)`."""

    def compute(self, x):
        return torch.relu(x)


class GELU(_Unary):
    """GELU; `approximate="tanh"` gives MindSpore's default approximation, `"none"` the exact erf form."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def compute(self, x):
        return F.gelu(x, approximate=self.approximate)


class Softmax(_Unary):
    """Softmax over `axis` (an int or a tuple); the softmax axes cannot be cut."""

    def __init__(self, axis: int | Sequence[int] = -1) -> None:
        super().__init__()
        self.axis = axis

    def uncut(self, shapes, *extra):
        labels = self.labels(shapes)[0]
        return {labels[a]: f"dim {a} is a softmax axis" for a in _axes(self.axis, len(shapes[0]))}

    def compute(self, x):
        axes = _axes(self.axis, x.ndim)
        if len(axes) == 1:
            return torch.softmax(x, axes[0])
        shifted = torch.exp(x - torch.amax(x, dim=axes, keepdim=True))
        return shifted / shifted.sum(dim=axes, keepdim=True)


class LayerNorm(Primitive):
    """Layer normalisation of `x` over dims `begin_norm_axis..`, scaled by `gamma` and shifted by `beta`
    (of shape `x.shape[begin_params_axis:]`). The normalised dims cannot be cut. Returns the output only."""

    input_names = ("x", "gamma", "beta")

    def __init__(self, begin_norm_axis: int = 1, begin_params_axis: int = 1, epsilon: float = 1e-7) -> None:
        super().__init__()
        self.begin_norm_axis, self.begin_params_axis, self.epsilon = (
            begin_norm_axis,
            begin_params_axis,
            epsilon,
        )

    def labels(self, shapes, *extra):
        x = DIMS[: len(shapes[0])]
        params = x[self.begin_params_axis % len(x) :]
        return [x, params, params]

    def uncut(self, shapes, *extra):
        x = self.labels(shapes)[0]
        start = self.begin_norm_axis % len(x)
        return {label: f"dim {d} is normalised by LayerNorm" for d, label in enumerate(x) if d >= start}

    def compute(self, x, gamma, beta):
        norm_shape = tuple(x.shape[self.begin_norm_axis % x.ndim :])
        if self.begin_norm_axis % x.ndim == self.begin_params_axis % x.ndim:
            return F.layer_norm(x, norm_shape, gamma, beta, self.epsilon)
        return F.layer_norm(x, norm_shape, None, None, self.epsilon) * gamma + beta


class MatMul(Primitive):
    """2-D `x @ w` (optionally transposed); cutting the contracted dim makes the output a pending sum."""

    input_names = ("x", "w")

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__()
        self.transpose_a, self.transpose_b = transpose_a, transpose_b

    def labels(self, shapes, *extra):
        for name, shape in zip(self.input_names, shapes, strict=True):
            if len(shape) != 2:
                raise ValueError(
                    f"MatMul: input {name} has shape {tuple(shape)}, but MatMul takes 2-D inputs; "
                    f"use BatchMatMul for batched or higher-rank inputs"
                )
        return ["ki" if self.transpose_a else "ik", "jk" if self.transpose_b else "kj"]

    def compute(self, x, w):
        return torch.matmul(x.mT if self.transpose_a else x, w.mT if self.transpose_b else w)


class BatchMatMul(MatMul):
    """Batched `x @ w` over the last two dims, with broadcasting batch dims.

    Computed on the local shards, as MindSpore does: the output's layout follows from the labels (batch dims,
    `i` and `j` keep their inputs' cuts; a cut `k` leaves a pending sum). DTensor's own rule for batched
    matmuls of rank > 3 flattens the batch dims, which it cannot do when one is cut over several mesh dims.
    """

    def compute(self, x, w):
        if not isinstance(x, DTensor):
            return super().compute(x, w)
        x_labels, w_labels = self.labels([x.shape, w.shape])
        batch = torch.broadcast_shapes(x.shape[:-2], w.shape[:-2])
        i, j = x.shape[-1 if self.transpose_a else -2], w.shape[-2 if self.transpose_b else -1]
        if any(p.is_partial() for t in (x, w) for p in t.placements):
            # a pending input (the automatic planner's projections with a cut contracted dim) is summed here
            # as the planner prices it; DTensor's rule would search every strategy over the mesh for it
            summed = self._summed(x, w, x_labels, w_labels)
            return super().compute(x, w) if summed is None else self.compute(*summed)
        axes, seen = {}, {}
        for labels, tensor in ((w_labels, w), (x_labels, x)):  # x's axes win where both have a label
            for label, size, dim_axes in zip(labels, tensor.shape, layout_of(tensor).dim_axes, strict=True):
                if size != 1 or label not in axes:
                    axes[label] = dim_axes
                if size != 1:
                    seen.setdefault(label, set()).add(dim_axes)
        used = [axis for dim_axes in axes.values() for axis in dim_axes]
        if len(used) != len(set(used)) or any(len(cuts) > 1 for cuts in seen.values()):
            # inputs no strategy laid out alike (the automatic planner's layouts): the local product cannot
            # say its output; the smaller input takes the other's cuts, or DTensor's rule moves them
            fitted = self._fitted(x, w, x_labels, w_labels)
            if fitted is None or (fitted[0] is x and fitted[1] is w):  # nothing moved: no local product
                return super().compute(x, w)
            return self.compute(*fitted)
        out_labels = BATCH[: len(batch)] + "ij"
        layout = TensorLayout(tuple(axes[label] for label in out_labels), partial=axes["k"])
        used = {axis for dim_axes in axes.values() for axis in dim_axes}
        local = super().compute(_local(x, used), _local(w, used))
        return DTensor.from_local(
            local,
            x.device_mesh,
            layout.placements(x.device_mesh.ndim),
            run_check=False,
            shape=torch.Size([*batch, i, j]),
            stride=torch.empty(0).new_empty([*batch, i, j]).stride(),
        )

    def _summed(self, x: DTensor, w: DTensor, x_labels: str, w_labels: str) -> tuple | None:
        """`x` and `w` with each pending sum reduce-scattered onto that input's contracted dim (all-reduced
        where the dim does not divide by the cuts), then laid out alike by `compute`; None when not both are
        DTensors on this primitive's mesh.

        The planner prices a pending input of a product as one reduce-scatter on the edge into it (the
        edges run through the views between, which carry the pending sum at run time). Onto the contracted
        dim, both inputs of a product of two pending sums (queries and keys after projections whose
        contracted dim is cut over dp) end cut alike there, and the product is pending again, as the
        planner chose. DTensor's own matmul rule, given a pending input on a mesh of 3 or more dims, prices
        every expanded strategy with its graph-based redistribution planner: minutes for one product of
        loom's GPT on 8 ranks (docs/planner.md, "8 ranks")."""
        mesh = self.mesh
        if mesh is None or not isinstance(w, DTensor) or x.device_mesh != mesh.device_mesh:
            return None
        sizes = mesh.device_mesh.shape
        summed = []
        for name, tensor, labels in (("x", x, x_labels), ("w", w, w_labels)):
            layout = layout_of(tensor)
            if not layout.partial:
                summed.append(tensor)
                continue
            k = labels.index("k")
            parts = math.prod(sizes[axis] for axis in (*layout.dim_axes[k], *layout.partial))
            # onto k only when the pending axes come after k's own cut axes (DTensor cuts in mesh order: an
            # earlier axis would reorder the cut, its slow path); otherwise summed whole
            inner = all(p > a for p in layout.partial for a in layout.dim_axes[k])
            onto = layout.partial if tensor.shape[k] % parts == 0 and inner else ()
            target = TensorLayout(
                tuple(
                    tuple(sorted((*axes, *onto))) if dim == k else axes
                    for dim, axes in enumerate(layout.dim_axes)
                )
            )
            summed.append(to_layout(tensor, target, mesh, f"{self.name} input {name}"))
        return tuple(summed)

    def _fitted(self, x: DTensor, w: DTensor, x_labels: str, w_labels: str) -> tuple | None:
        """`x` and `w` with the smaller one moved to the other's cuts of their shared dims, its own dims
        keeping the mesh dims the other leaves free; None when not both are DTensors on this primitive's mesh.

        DTensor's own rule would do as well, but on a mesh of 3 or more dims its strategy expansion prices
        every candidate with its graph-based redistribution planner (a view of a sequence-cut activation
        is a `_StridedShard`): minutes for one matmul of loom's GPT on 8 ranks."""
        mesh = self.mesh
        if mesh is None or not isinstance(w, DTensor) or x.device_mesh != mesh.device_mesh:
            return None
        move_x = x.numel() < w.numel()
        (big, big_labels), (small, small_labels) = (
            ((w, w_labels), (x, x_labels)) if move_x else ((x, x_labels), (w, w_labels))
        )
        cut = {
            label: axes
            for label, size, axes in zip(big_labels, big.shape, layout_of(big).dim_axes, strict=True)
            if size != 1
        }
        taken = {axis for axes in cut.values() for axis in axes}
        own = layout_of(small).dim_axes
        target = TensorLayout(
            tuple(
                () if size == 1 else cut[label] if label in cut else tuple(a for a in axes if a not in taken)
                for label, size, axes in zip(small_labels, small.shape, own, strict=True)
            )
        )
        moved = to_layout(small, target, mesh, f"{self.name} input {'x' if move_x else 'w'}")
        return (moved, w) if move_x else (x, moved)

    def labels(self, shapes, *extra):
        x, w = shapes
        if len(x) < 2 or len(w) < 2:
            raise ValueError(f"BatchMatMul: inputs need at least 2 dims, got {tuple(x)} and {tuple(w)}")
        batch = max(len(x), len(w)) - 2
        batch_labels = BATCH[:batch]
        x_tail = "ki" if self.transpose_a else "ik"
        w_tail = "jk" if self.transpose_b else "kj"
        return [batch_labels[batch - (len(x) - 2) :] + x_tail, batch_labels[batch - (len(w) - 2) :] + w_tail]


def _local(t: DTensor, used_axes: set[int]) -> torch.Tensor:
    """`t`'s shard, whose gradient is a pending sum over the mesh dims that other operands are cut on."""
    grad_placements = [
        p if p.is_shard() or axis not in used_axes else Partial() for axis, p in enumerate(t.placements)
    ]
    return _ContiguousGrad.apply(t.to_local(grad_placements=grad_placements))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. The local product's input gradients can be
    transposed views (the gradient of `w.mT`); loom's GPT on 8 ranks (keys cut over sequence and batch)
    then met, in backward, a key gradient whose DTensor strides and local strides ordered its dims
    differently, and a `view` that DTensor allowed by the former failed on the latter. A contiguous local
    gradient gives the DTensor that `to_local`'s backward builds contiguous strides on both sides. After a
    DTensor `Reshape` likewise: its backward views the gradient back, which fails on a local gradient a
    later permute of heads left non-contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad.contiguous()


class Gather(Primitive):
    """Rows of a 2-D `params` picked by integer `indices` (an embedding lookup): `Gather()(params, indices)`.

    Cutting the rows of `params` (a vocabulary-parallel embedding) leaves a pending sum in which each rank
    fills the rows it holds; cutting its columns cuts the output's last dim.
    """

    input_names = ("params", "indices")

    def labels(self, shapes, *extra):
        if len(shapes[0]) != 2:
            raise ValueError(f"Gather: params has shape {tuple(shapes[0])}; Gather takes a 2-D table of rows")
        return ["yz", DIMS[: len(shapes[1])]]

    def compute(self, params, indices):
        if not isinstance(params, DTensor):
            return F.embedding(indices, params)
        # Computed on the local shards, as MindSpore does: DTensor's own rule cannot cut the rows over
        # several mesh dims. Each rank looks up the ids that fall in its rows and zeroes the others.
        table, ids = layout_of(params), layout_of(indices)
        mesh = params.device_mesh
        rows = table.dim_axes[0]
        axes = [axis for dims in ids.dim_axes for axis in dims] + list(table.dim_axes[1]) + list(rows)
        if len(axes) != len(set(axes)):
            # one mesh dim cuts the ids and the table (layouts the automatic planner chose, which no
            # strategy of this operator names): the local lookup cannot say its output, DTensor's rule can
            return F.embedding(indices, params)
        block = params.shape[0] // table.cuts(mesh.shape)[0]
        coordinate = mesh.get_coordinate()
        index = 0
        for axis in rows:
            index = index * mesh.shape[axis] + coordinate[axis]
        used = {axis for axes in table.dim_axes + ids.dim_axes for axis in axes}
        local_ids = indices.to_local() - index * block
        outside = (local_ids < 0) | (local_ids >= block)
        out = F.embedding(local_ids.masked_fill(outside, 0), _local(params, used))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        layout = TensorLayout(ids.dim_axes + (table.dim_axes[1],), partial=rows)
        shape = torch.Size([*indices.shape, params.shape[1]])
        return DTensor.from_local(
            out,
            mesh,
            layout.placements(mesh.ndim),
            run_check=False,
            shape=shape,
            stride=torch.empty(0).new_empty(shape).stride(),
        )


class Transpose(_Unary):
    """`x` with its dims permuted: called as `Transpose()(x, perm)`."""

    def compute(self, x, perm):
        return x.permute(*perm)


class Reshape(_Unary):
    """`x` reshaped: called as `Reshape()(x, shape)`. The input is laid out by the strategy; a cut survives
    when its dim leads the group of dims that become one output dim (or is split with the cut dividing the
    leading part); any other cut is gathered first, since no strategy could name the result."""

    def compute(self, x, shape):
        if not isinstance(x, DTensor):
            return x.reshape(shape)
        x = _keep_reshapeable_cuts(x, tuple(torch.empty(0).new_empty(x.shape).reshape(shape).shape))
        return _ContiguousGrad.apply(x.reshape(shape))  # its backward views the gradient back


def _reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product (as a view maps them)."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        ins, outs = [], []
        a = b = 1
        while True:
            if a <= b and i < len(in_shape):
                a *= in_shape[i]
                ins.append(i)
                i += 1
            elif j < len(out_shape):
                b *= out_shape[j]
                outs.append(j)
                j += 1
            else:
                break
            if (
                a == b
                and (i == len(in_shape) or in_shape[i] != 1)
                and (j == len(out_shape) or out_shape[j] != 1)
            ):
                break
        groups.append((ins, outs))
    return groups


def _keep_reshapeable_cuts(x: DTensor, out_shape: tuple[int, ...]) -> DTensor:
    layout = layout_of(x)
    cuts = layout.cuts(x.device_mesh.shape)
    keep = [False] * x.ndim
    for ins, outs in _reshape_groups(x.shape, out_shape):
        lead_in = next((d for d in ins if x.shape[d] != 1), None)
        lead_out = next((d for d in outs if out_shape[d] != 1), None)
        if lead_in is not None and lead_out is not None and out_shape[lead_out] % cuts[lead_in] == 0:
            keep[lead_in] = True
    wanted = TensorLayout(
        tuple(axes if keep[d] else () for d, axes in enumerate(layout.dim_axes)), layout.partial
    )
    if wanted == layout:
        return x
    return x.redistribute(x.device_mesh, wanted.placements(x.device_mesh.ndim))


class _Reduce(_Unary):
    def __init__(self, keep_dims: bool = False) -> None:
        super().__init__()
        self.keep_dims = keep_dims


class ReduceSum(_Reduce):
    """Sum over `axis` (all dims by default): `ReduceSum(keep_dims)(x, axis)`. Cut axes give a pending sum."""

    def compute(self, x, axis=()):
        return x.sum(dim=_axes(axis, x.ndim), keepdim=self.keep_dims)


class ReduceMean(_Reduce):
    """Mean over `axis` (all dims by default): `ReduceMean(keep_dims)(x, axis)`."""

    def compute(self, x, axis=()):
        return x.mean(dim=_axes(axis, x.ndim), keepdim=self.keep_dims)
