"""`loom.parallelize(model, mode="auto")`: the planner chooses the layouts, then they are applied as a Plan.

Rank 0 captures the model on the example batch (at its global size: every data-parallel rank brings its
own rows), builds the priced problem on the current mesh and solves it (`loom.plan.mesh_search.solve_model`,
as `loom plan --model MODULE:FUNCTION` does per mesh, under `memory_limit` when given: the model's own bytes
per device, where `loom plan`'s `--memory-limit` also holds the device's reserved memory; the local regions of
the model's recipe, Mixtral's experts, read their parameters whole and run on each rank's rows); the chosen Plan travels to every rank as JSON, so all ranks apply the same one
even where the solver could break a tie differently. The capture traces with fake tensors: no parameter
memory is allocated.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.cost.traffic import StepCollective
from loom.dist.mesh import Mesh
from loom.layout.named import on_mesh_axes
from loom.layout.redistribute import to_layout
from loom.layout.tensor_layout import TensorLayout
from loom.plan import Plan
from loom.shard import lay_out_inputs

__all__ = ["auto_plan", "global_meta", "read_in_compute_layouts", "read_inputs_in"]


def auto_plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    *,
    full_batch: bool,
    memory_limit: float | None,
    cluster: str,
    bucket_mb: float = 25.0,
) -> tuple[Plan, list[StepCollective] | None]:
    """The Plan the full search picks for `model` on `mesh` (see the module docstring), and the collectives
    one training step under it issues on a rank, as its solution predicts them (`Solution.
    predicted_collectives`, with `bucket_mb` and `full_batch` as `loom.parallelize` takes them; None, with
    a warning on rank 0, when the prediction failed)."""
    answer = None
    if dist.get_rank() == 0:
        try:
            answer = ("plan", _solve(model, mesh, example_inputs or (), example_kwargs or {}, full_batch,
                                     memory_limit, cluster, bucket_mb))  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every rank must learn of it, not only rank 0
            answer = ("error", f"{type(error).__name__}: {error}")
    box = [answer]
    dist.broadcast_object_list(box, src=0)
    kind, found = box[0]
    if kind == "error":
        raise ValueError(f"parallelize(mode='auto'): the planner failed on rank 0: {found}")
    text, predicted = found
    collectives = None if predicted is None else [StepCollective(**entry) for entry in predicted]
    return Plan.from_json(text, "the automatic plan"), collectives


def _solve(
    model, mesh, args, kwargs, full_batch, memory_limit, cluster, bucket_mb
) -> tuple[str, list | None]:  # noqa: ANN001
    from loom.plan.capture import capture  # the planner's imports (torch.export, scipy) only when asked
    from loom.plan.mesh_search import solve_model

    factor = 1 if full_batch else mesh.dp_size
    graph = capture(model, tuple(_global(x, factor) for x in args),
                    {key: _global(value, factor) for key, value in kwargs.items()})  # fmt: skip
    solution, plan = solve_model(model, graph, dict(mesh.axis_sizes()), cluster, memory_limit)
    return plan.to_json(), _prediction(solution, mesh, bucket_mb, full_batch)


def _prediction(solution: Any, mesh: Mesh, bucket_mb: float, full_batch: bool) -> list | None:
    """The solution's predicted collectives of a step, as plain dicts; None, with a warning naming the
    cause, when predicting fails: the plan stands without its prediction. Predicted here, where the
    solution is: the solver may break ties differently on another run."""
    try:
        predicted = solution.predicted_collectives(
            device=mesh.device_mesh.device_type, bucket_mb=bucket_mb, full_batch=full_batch
        )
    except Exception as error:  # noqa: BLE001 - a prediction is a report, never a reason not to train
        warnings.warn(
            f"parallelize(mode='auto'): the plan is applied, but predicting its step's collectives failed "
            f"({type(error).__name__}: {error}); model.loom.predicted_collectives is None",
            stacklevel=2,
        )
        return None
    return [dataclasses.asdict(c) for c in predicted]


def _global(x: Any, batch_factor: int) -> Any:
    """`x` at the global batch size, on its own device (the capture runs the model's parameters as fake
    tensors of theirs): this rank's rows repeated, so that token ids, masks and positions stay valid."""
    if not isinstance(x, torch.Tensor) or not x.ndim:
        return x
    return x.repeat(batch_factor, *[1] * (x.ndim - 1))


def global_meta(x: Any, batch_factor: int) -> Any:
    """`x` on the meta device with its batch dim (dim 0) at the global size."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = list(x.shape)
    if shape:
        shape[0] *= batch_factor
    return torch.empty(shape, dtype=x.dtype, device="meta")


def read_in_compute_layouts(model: nn.Module, layouts: Mapping[str, TensorLayout], mesh: Mesh) -> None:
    """A Plan's `compute_layouts` applied: each parameter named in `layouts` (path -> layout) is read by its
    module's forward in that layout, moved when the forward starts (DTensor's collectives, differentiable:
    its gradient goes back to the layout it is kept in, an all-gather's as a reduce-scatter).

    The planner priced that move on the edge into the parameter's consumer. Left to DTensor, an operator
    whose inputs do not fit together moves whichever its own costs prefer, which is not what was priced
    and may leave gradients in layouts DTensor's rules mishandle (docs/planner.md, "8 ranks")."""
    by_module: dict[str, dict[str, TensorLayout]] = {}
    for name, layout in layouts.items():
        path, _, short = name.rpartition(".")
        by_module.setdefault(path, {})[short] = layout
    for path, params in by_module.items():
        module = model.get_submodule(path)
        missing = [short for short in params if short not in module._parameters]
        if missing:
            raise ValueError(
                f"plan.compute_layouts names {path}.{missing[0]}, which is not a parameter of its module "
                f"{type(module).__name__}; the plan was made for another model"
            )
        module.register_forward_pre_hook(partial(_read_in, params=params, mesh=mesh, path=path))
        module.register_forward_hook(partial(_read_done, names=tuple(params)), always_call=True)


def _read_in(
    module: nn.Module, _args: Any, *, params: Mapping[str, TensorLayout], mesh: Mesh, path: str
) -> None:
    # an instance attribute shadows the registered parameter for the forward's `self.weight` reads only:
    # the parameter itself (its `.grad`, `named_parameters`, the optimizer's) stays where it is kept
    for short, layout in params.items():
        module.__dict__[short] = to_layout(
            module._parameters[short], layout, mesh, f"parameter {path}.{short}"
        )


def _read_done(module: nn.Module, _args: Any, _output: Any, *, names: Sequence[str]) -> None:
    for short in names:
        module.__dict__.pop(short, None)


def read_inputs_in(model: nn.Module, layouts: Mapping[str, Any], mesh: Mesh) -> None:
    """A Plan's `input_layouts` applied: each input of `model.forward` named in `layouts` (argument name ->
    tensor spec), positional or keyword, is moved to that layout when the forward starts, after it became
    a DTensor of this rank's rows. The planner priced that move on the edges into the input's readers;
    left to DTensor, a reader would run on the rows as they arrive (data parallel), which was not priced."""
    if not layouts:
        return
    signature = inspect.signature(model.forward)
    named = {p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    extra = next((p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD), None)
    unknown = sorted(set(layouts) - named) if extra is None else []  # `**kwargs` may bring any keyword
    if unknown:
        raise ValueError(
            f"plan.input_layouts names {unknown[0]!r}, which is not an argument of "
            f"{type(model).__name__}.forward {tuple(signature.parameters)}; the plan was made for another model"
        )
    entries = {name: on_mesh_axes(spec, mesh.axis_sizes()) for name, spec in layouts.items()}
    model.register_forward_pre_hook(
        partial(_inputs_in, signature=signature, entries=entries, mesh=mesh, extra=extra), with_kwargs=True
    )


def _inputs_in(
    _module: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    signature: inspect.Signature,
    entries: Mapping,
    mesh: Mesh,
    extra: str | None,
) -> tuple[tuple, dict]:
    bound = signature.bind_partial(*args, **kwargs)
    # a keyword `forward` takes into its `**kwargs` (named `extra`) is read from that dict
    keywords = bound.arguments.get(extra, {}) if extra is not None else {}
    for name, entry in entries.items():
        where = bound.arguments if name in signature.parameters else keywords
        value = where.get(name)
        if isinstance(value, DTensor):  # only inside a parallelized forward (a gathered copy runs as is)
            (where[name],) = lay_out_inputs(f"input {name!r}", (value,), (entry,), mesh)
    return tuple(bound.args), dict(bound.kwargs)
