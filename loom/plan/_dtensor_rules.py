"""The one door to DTensor's private sharding rules: ask DTensor what an operator does with given input
placements, on a mesh that needs no processes.

DTensor keeps a sharding rule for about 1,200 ATen operators in its `ShardingPropagator`
(`torch.distributed.tensor._sharding_prop`, reached as `DTensor._op_dispatcher.sharding_propagator`), all
private API. Everything loom uses of it lives here, listed in `PRIVATE_API`; `check()` reports what moved
and `tests/test_plan_space.py` fails loudly on it, naming the missing piece.

The entry used is the propagator's own `propagate_op_sharding_non_cached(OpSchema)`, the function DTensor's
dispatcher calls for every operator: given the placements of the inputs, it answers the output placements
and the input placements the operator needs (when they differ, DTensor would redistribute first). Going
through the same entry as a real run means the answers are DTensor's, whatever mechanism holds an
operator's rule (strategy functions, single-mesh-dim strategies, propagation rules, decompositions).

Meshes are one-dimensional and built without process groups (`DeviceMesh(..., _init_backend=False)`):
rules read only the mesh's shape. CPU flash attention has no rule of its own; it computes what the GPU
attention kernels compute, so it is asked as `_scaled_dot_product_flash_attention` (without a mask) or as
`_scaled_dot_product_efficient_attention` (with one: its bias takes the mask expanded to every head, and a
cut of a dim the mask broadcasts is reported as no cut).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard
from torch.utils import _pytree as pytree

__all__ = [
    "PRIVATE_API",
    "Proposal",
    "axis_mesh",
    "check",
    "cuts_a_dim_twice",
    "dispatch",
    "is_cut",
    "is_strided",
    "nd_mesh",
    "propose",
    "refuses_dims_cut_twice",
]

PRIVATE_API = (
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator",
    "ShardingPropagator.propagate_op_sharding_non_cached",
    "ShardingPropagator.op_to_schema_info",
    "ShardingPropagator.op_to_rules",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._op_schema.OpSchema",
    "torch.distributed.tensor._op_schema.OutputSharding.output_spec / .redistribute_schema",
    "DeviceMesh(..., _init_backend=False, _rank=0)",
    "torch.distributed.tensor.placement_types._StridedShard (a view's cut of a flattened dim)",
)
"""The private pieces of torch this module relies on (what `check` verifies)."""

aten = torch.ops.aten


def is_strided(placement: Placement) -> bool:
    """Whether `placement` is DTensor's `_StridedShard`: the cut of a dim made by flattening a tensor cut along
    a later dim (a view's output). Asked before `Shard` everywhere: torch made it a `Shard` subclass before
    it isolated it (pytorch#167887), so `isinstance(p, Shard)` alone answers differently across versions."""
    return isinstance(placement, _StridedShard)


def strided(dim: int, split_factor: int) -> Placement:
    """DTensor's strided cut of `dim` with `split_factor` (see `is_strided`)."""
    return _StridedShard(dim, split_factor=split_factor)


def placement_key(placement: Placement | None) -> Any:
    """`placement` as a value equal for equal placements: DTensor's masked partial sum (`_MaskPartial`, an
    embedding's output over a table cut along its rows) compares its mask buffer by identity, so two made
    apart (a candidate, and DTensor's answer for the same layouts) are never equal as objects."""
    if placement is not None and hasattr(placement, "mask_buffer") and hasattr(placement, "offset_shape"):
        return ("masked", placement.reduce_op, tuple(placement.offset_shape), placement.offset_dim)
    return placement


def layouts_key(layouts: Sequence[Sequence[Placement] | None]) -> tuple:
    """Layouts (one tuple of placements per tensor, None for an output that is not one) as a value equal for
    equal layouts (`placement_key`)."""
    return tuple(None if ps is None else tuple(placement_key(p) for p in ps) for ps in layouts)


def is_cut(placement: Placement) -> bool:
    """Whether `placement` cuts the tensor, each device holding one part along its axis: a `Shard` or a
    strided cut (`is_strided`)."""
    return isinstance(placement, Shard) or is_strided(placement)


def refuses_dims_cut_twice(op: Any) -> bool:
    """Whether DTensor runs `op` by a propagation rule (`register_prop_rule`: the convolutions in torch
    2.13), which describes a layout by its `dim_map`, one mesh axis per tensor dim: such an operator refuses
    a tensor whose dim is cut over two mesh axes (`cuts_a_dim_twice`; "does not support things like hybrid
    sharding"), even as it arrives, before it could move it. A one-axis question (`propose`) cannot meet that
    refusal, so the strategy space and the edges into such an operator ask this."""
    return op in _propagator().op_to_rules


def cuts_a_dim_twice(placements: Sequence[Placement]) -> bool:
    """Whether `placements` (one per mesh axis) cut one tensor dim over two mesh axes."""
    dims = [p.dim for p in placements if is_cut(p)]
    return len(dims) != len(set(dims))


@dataclass(frozen=True)
class Proposal:
    """DTensor's answer for one operator call: the placement each tensor input must have (flattened argument
    order) and the placement of each output (None for an output that is not a tensor); one placement each
    from `propose` (a one-axis mesh), a tuple of one per mesh axis from `dispatch`."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]


def _propagator() -> Any:
    return DTensor._op_dispatcher.sharding_propagator


def axis_mesh(size: int) -> DeviceMesh:
    """A one-dimensional CPU mesh of `size` devices, without process groups (nothing is communicated)."""
    return nd_mesh((size,))


@functools.cache
def nd_mesh(sizes: tuple[int, ...]) -> DeviceMesh:
    """A CPU mesh of shape `sizes` (outermost axis first), without process groups (nothing is
    communicated)."""
    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).reshape(sizes), _init_backend=False, _rank=0)


def propose(
    op: Any, args: tuple, kwargs: dict, placements: Sequence[Placement], size: int
) -> Proposal | None:
    """What DTensor does with `op(*args, **kwargs)` when its tensor arguments (meta tensors, in flattened
    order) have `placements` on a mesh axis of `size` devices; None when DTensor refuses those placements
    or has no rule for the operator."""
    answer = dispatch(op, args, kwargs, [(p,) for p in placements], (size,))
    if answer is None:
        return None
    inputs = tuple(ps[0] for ps in answer.inputs)
    return Proposal(inputs=inputs, outputs=tuple(ps[0] if ps is not None else None for ps in answer.outputs))


def dispatch(
    op: Any, args: tuple, kwargs: dict, placements: Sequence[tuple[Placement, ...]], sizes: tuple[int, ...]
) -> Proposal | None:
    """What DTensor's dispatcher runs for `op(*args, **kwargs)` when its tensor arguments (meta tensors, in
    flattened order) arrive with `placements` (one placement per mesh axis) on a mesh of `sizes`: the
    placements it moves each input to first (its strategy of least redistribution cost, by its own
    `redistribute_cost`) and those of each output, as tuples per mesh axis; None when DTensor refuses those
    placements or has no rule for the operator."""
    alias = _alias(op, args, kwargs)
    if alias is not None:
        op, args, kwargs, placements = alias.op, alias.args, alias.kwargs, alias.to_alias(placements)
    mesh = nd_mesh(tuple(sizes))
    supply = iter(placements)
    to_spec = lambda t: _spec(t, next(supply), mesh)
    args_schema, kwargs_schema = pytree.tree_map_only(torch.Tensor, to_spec, (tuple(args), dict(kwargs)))
    from torch.distributed.tensor._op_schema import OpSchema

    propagator = _propagator()
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=_schema_info(propagator, op))
    try:
        result = propagator.propagate_op_sharding_non_cached(schema)
    except Exception:  # a refusal takes many forms (NotImplementedError, AssertionError, ...)
        return None
    required = result.redistribute_schema or schema
    inputs = tuple(tuple(s.placements) for s in _specs((required.args_schema, required.kwargs_schema)))
    outputs = result.output_spec if isinstance(result.output_spec, tuple | list) else (result.output_spec,)
    outputs = tuple(tuple(s.placements) if s is not None else None for s in outputs)
    if alias is not None:
        inputs, outputs = alias.back(inputs), outputs[: alias.outputs]
    if len(inputs) != len(placements) or (outputs and all(p is None for p in outputs)):
        return None
    return Proposal(inputs=inputs, outputs=outputs)


def _schema_info(propagator: Any, op: Any) -> Any:
    """The runtime schema info DTensor's dispatcher attaches to `op` (which arguments its rule reads)."""
    info = propagator.op_to_schema_info.get(op)
    if info is None:  # torch 2.13 files single-mesh-dim strategies separately
        info = getattr(propagator, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
    return info


def _spec(tensor: torch.Tensor, placements: tuple[Placement, ...], mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(tensor.shape, tensor.stride(), tensor.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _specs(tree: Any) -> list[Any]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, DTensorSpec)]


@dataclass(frozen=True)
class _Alias:
    """An operator asked as another one with the same sharding semantics: its call, how many of its
    outputs are the original's, and each original input's shape and its dims' offset in the other
    operator's input (a mask broadcast to more dims)."""

    op: Any
    args: tuple
    kwargs: dict
    outputs: int
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    def to_alias(self, placements: Sequence[tuple[Placement, ...]]) -> tuple[tuple[Placement, ...], ...]:
        """The original inputs' placements (one per mesh axis), as the other operator's inputs."""
        return tuple(
            tuple(Shard(p.dim + offset) if isinstance(p, Shard) else p for p in ps)
            for ps, offset in zip(placements, self.offsets, strict=True)
        )

    def back(self, placements: Sequence[tuple[Placement, ...]]) -> tuple[tuple[Placement, ...], ...]:
        """The other operator's input placements, as the original inputs': a cut of a dim the original
        broadcasts (absent, or of size 1) is no cut."""
        found = []
        for ps, shape, offset in zip(placements, self.shapes, self.offsets, strict=True):
            found.append(tuple(_unbroadcast(p, shape, offset) for p in ps))
        return tuple(found)


def _unbroadcast(p: Placement, shape: tuple[int, ...], offset: int) -> Placement:
    if isinstance(p, Shard):
        dim = p.dim - offset
        return Shard(dim) if dim >= 0 and shape[dim] > 1 else Replicate()
    return p


def _alias(op: Any, args: tuple, kwargs: dict) -> _Alias | None:
    """CPU flash attention as flash attention (no mask) or as memory-efficient attention (a mask, expanded
    to every head as that operator's bias is)."""
    if op is not aten._scaled_dot_product_flash_attention_for_cpu.default:
        return None
    query, key, value, *rest = args
    dropout = rest[0] if rest else 0.0
    causal = rest[1] if len(rest) > 1 else False
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    shapes = tuple(tuple(t.shape) for t in (query, key, value))
    if mask is None:
        call = (query, key, value, dropout, causal, False)
        flash = aten._scaled_dot_product_flash_attention.default
        return _Alias(flash, call, {"scale": scale}, 2, shapes, (0, 0, 0))
    bias = mask.expand(*query.shape[:-1], key.shape[-2])
    call = (query, key, value, bias, True, dropout, causal)
    efficient = aten._scaled_dot_product_efficient_attention.default
    offsets = (0, 0, 0, bias.ndim - mask.ndim)
    return _Alias(efficient, call, {"scale": scale}, 2, (*shapes, tuple(mask.shape)), offsets)


def check() -> list[str]:
    """What of `PRIVATE_API` is missing or behaves differently in this torch (empty when all is well): a
    matmul with a row-parallel cut must come back as a pending sum."""
    problems = []
    try:
        propagator = _propagator()
    except AttributeError as error:
        return [f"DTensor._op_dispatcher.sharding_propagator is gone ({error})"]
    for name in ("propagate_op_sharding_non_cached", "op_to_schema_info", "op_to_rules"):
        if not hasattr(propagator, name):
            problems.append(f"ShardingPropagator.{name} is gone")
    try:
        axis_mesh(2)
    except Exception as error:
        problems.append(f"DeviceMesh(..., _init_backend=False, _rank=0) fails: {error!r}")
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
        from torch.distributed.tensor._op_schema import OpSchema, OutputSharding  # noqa: F401
    except ImportError as error:
        problems.append(f"DTensor's spec classes moved: {error}")
    strided = _StridedShard(0, split_factor=2)
    if (strided.dim, strided.split_factor) != (0, 2):
        problems.append("_StridedShard(dim, split_factor=) no longer keeps its dim and split factor")
    if problems:
        return problems
    from torch.distributed.tensor import Partial, Shard

    x, w = torch.empty(8, 4, device="meta"), torch.empty(4, 6, device="meta")
    answer = propose(aten.mm.default, (x, w), {}, (Shard(1), Shard(0)), 2)
    if answer is None or not isinstance(answer.outputs[0], Partial):
        problems.append(f"mm(Shard(1), Shard(0)) should give a Partial output, DTensor answered {answer}")
    return problems
