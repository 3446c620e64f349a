"""`loom.shard`: run a function or module with its inputs laid out by MindSpore-style strategies.

Global semantics: the call computes what the unsharded call computes. loom redistributes each input to its
layout, runs the function on DTensors (whose sharding rules pick the local computation), and redistributes the
output when `out_strategy` is given. A plain tensor passed in is the same global tensor on every rank, and its
gradient comes back whole on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist import consistency
from loom.dist.context import require_mesh
from loom.dist.mesh import Mesh
from loom.layout import compile_inputs, to_layout
from loom.layout.named import on_mesh_axes
from loom.layout.parameters import lay_out_parameters


def shard(
    fn_or_module: Callable[..., Any] | nn.Module,
    in_strategy: tuple,
    out_strategy: tuple | None = None,
    parameter_plan: dict[str, tuple | Any] | None = None,
) -> Any:
    """Shard a function or module: `in_strategy` has one entry per positional input (cuts per dim, a
    `Layout` map, mesh axis names per dim such as `("dp", "None")`, or None to leave that input as it
    comes); `out_strategy` one per output.

    A module's parameters are laid out now, as `parameter_plan` (name -> entry) says, the others replicated;
    the module itself is returned with hooks that lay out its inputs and outputs.
    """
    mesh = require_mesh("loom.shard")
    in_strategy, out_strategy = _on_mesh(in_strategy, mesh), _on_mesh(out_strategy, mesh)
    if isinstance(fn_or_module, nn.Module):
        return _shard_module(fn_or_module, in_strategy, out_strategy, parameter_plan or {}, mesh)
    if parameter_plan:
        raise ValueError("loom.shard: parameter_plan applies to modules only; this is a function")
    name = getattr(fn_or_module, "__name__", type(fn_or_module).__name__)
    check = consistency.FirstCall()

    @functools.wraps(fn_or_module)
    def sharded(*args: Any, **kwargs: Any) -> Any:
        args = lay_out_inputs(name, args, in_strategy, mesh, check, out_strategy)
        return lay_out_outputs(name, fn_or_module(*args, **kwargs), out_strategy, mesh)

    return sharded


def _on_mesh(strategy: tuple | None, mesh: Mesh) -> tuple | None:
    """Entries that name mesh axes (`("dp", "None")`) as `Layout` maps over the mesh; others as given."""
    if not isinstance(strategy, tuple | list):
        return strategy
    return tuple(on_mesh_axes(entry, mesh.axis_sizes()) for entry in strategy)


def lay_out_inputs(
    op: str,
    args: Sequence[Any],
    in_strategy: tuple,
    mesh: Mesh,
    check: consistency.FirstCall | None = None,
    out_strategy: tuple | None = None,
) -> tuple:
    """The positional inputs redistributed to their strategy entries (non-tensors pass through); with
    `check`, the consistency check first when it is due (see `loom.dist.consistency`)."""
    names = [f"#{i}" for i in range(len(args))]
    shapes = [a.shape if isinstance(a, torch.Tensor) else None for a in args]
    layouts = compile_inputs(op, names, in_strategy, shapes, mesh.canonical_shape)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if check is not None and check.due() and consistency.checkable(tensors):
        check.done = True
        consistency.submit(
            _claims(op, args, layouts, in_strategy, out_strategy, mesh), mesh, f"loom.shard({op})"
        )
    return tuple(
        a if layout is None else to_layout(a, layout, mesh, f"{op} input {i}")
        for i, (a, layout) in enumerate(zip(args, layouts, strict=True))
    )


def _claims(
    op: str,
    args: Sequence[Any],
    layouts: Sequence,
    in_strategy: tuple,
    out_strategy: tuple | None,
    mesh: Mesh,
) -> list[consistency.Claim]:
    """The plain tensors laid out here (each the same global tensor on every rank), then the strategy."""
    names, shape = mesh.device_mesh.mesh_dim_names, mesh.canonical_shape
    claims = [
        consistency.tensor_claim(
            f"loom.shard({op}) input #{i} (a plain tensor)", a, consistency.REPLICATED_FIX
        )
        for i, (a, layout) in enumerate(zip(args, layouts, strict=True))
        if layout is not None and not isinstance(a, DTensor)
    ]
    text = f"loom.shard({op}, {in_strategy!r}, {out_strategy!r}) on inputs " + ", ".join(
        f"#{i} {tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__} -> "
        + ("as it comes" if layout is None else layout.describe(names, shape))
        for i, (a, layout) in enumerate(zip(args, layouts, strict=True))
    )
    claims.append(consistency.text_claim(f"the strategy of loom.shard({op})", text, consistency.STRATEGY_FIX))
    return claims


def lay_out_outputs(op: str, out: Any, out_strategy: tuple | None, mesh: Mesh) -> Any:
    """The output(s) redistributed to `out_strategy` (one entry per output), or unchanged when None."""
    if out_strategy is None:
        return out
    single = not isinstance(out, tuple)
    outputs = lay_out_inputs(f"{op} (outputs)", (out,) if single else out, out_strategy, mesh)
    return outputs[0] if single else outputs


def _shard_module(
    module: nn.Module, in_strategy: tuple, out_strategy: tuple | None, parameter_plan: dict, mesh: Mesh
) -> nn.Module:
    op = type(module).__name__
    shapes = {name: p.shape for name, p in module.named_parameters(remove_duplicate=False)}
    layouts = {}
    for name, entry in parameter_plan.items():
        if name not in shapes:
            raise ValueError(
                f"loom.shard({op}): parameter_plan names unknown parameter {name!r}; "
                f"the parameters are {sorted(shapes)}"
            )
        (layouts[name],) = compile_inputs(
            f"{op} parameter {name}",
            [name],
            (on_mesh_axes(entry, mesh.axis_sizes()),),
            [shapes[name]],
            mesh.canonical_shape,
        )
    lay_out_parameters(module, {k: v for k, v in layouts.items() if v is not None}, mesh)
    check = consistency.FirstCall()
    module.register_forward_pre_hook(
        lambda _, args: lay_out_inputs(op, args, in_strategy, mesh, check, out_strategy)
    )
    module.register_forward_hook(lambda _, __, out: lay_out_outputs(op, out, out_strategy, mesh))
    return module
