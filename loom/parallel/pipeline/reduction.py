"""A pipeline rank's gradient reduction: one `GradSync` over its stages, overlapped with their last backward.

Every pipeline case reduces its gradients this one way. The routes:
- a plain stage (no tensor parallelism): every gradient averaged over the stage's data-parallel replicas;
- a stage laid out on a stage mesh (tp > 1): each DTensor gradient's pending sums, over the mesh dims that
  hold them (`dtensor_route`, as `loom.parallelize` does);
- a tied parameter (a GPT's embedding, whose copies sit on the first and the last pipeline rank): the same
  reduction widened to the ranks that hold a copy (`Tied.group`: both holders' replicas), so one collective
  sums the copies and averages the replicas. No other pipeline rank takes part.

The `GradSync` is enabled only during each stage's last backward pass of a step (the schedule says which:
its `last_backward`; in a zero-bubble schedule the last weight-gradient pass), so its buckets are reduced
while the rest of that backward runs; `Pipeline.step` finishes the reduction after the schedule. A
parameter that two stages of this rank share (the tied embedding of a V placement) is final after both
stages' last passes (`GradSync.final_passes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist.mesh import Mesh
from loom.parallel.grad_sync import GradSync, Route
from loom.parallel.pipeline.tied import Tied
from loom.parallel.routes import data_parallel_route, dtensor_route, fix_placements


def stage_grad_sync(
    modules: Sequence[nn.Module],
    *,
    stage_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    mesh: Mesh | None,
    tied: Sequence[Tied],
    bucket_mb: float = 25.0,
) -> GradSync:
    """The `GradSync` of this rank's stages `modules`: its agreement among `stage_group` (the ranks that run
    these stages: data-parallel replicas x tensor-parallel ranks), its routes as the module's docstring says
    (`mesh`: the stage mesh of DTensor stages; `dp_group`: the replicas of plain ones, None for none). It
    starts disabled and finishes when told (see `Pipeline`)."""
    module = nn.ModuleList(modules)
    route = stage_route(dp_group, mesh, tied)
    sync = GradSync(module, route, bucket_mb, group=stage_group, auto_finish=False)
    sync.enabled = False
    if mesh is not None:
        sync.after_sync = fix_placements(sync.params)  # as ParallelState.materialize sets it
    uses: dict[nn.Parameter, int] = {}
    for stage in modules:
        for param in dict.fromkeys(stage.parameters()):
            uses[param] = uses.get(param, 0) + 1
    sync.final_passes = {param: count for param, count in uses.items() if count > 1}
    return sync


def stage_route(dp_group: dist.ProcessGroup | None, mesh: Mesh | None, tied: Sequence[Tied]):
    """The route function of a pipeline rank's stages (see the module's docstring); for plain stages every
    route is known before backward (`static`)."""
    base = dtensor_route(mesh) if mesh is not None else None
    average = data_parallel_route(dp_group) if mesh is None and dp_group is not None else None
    copies = {id(t.param): t for t in tied if t.param is not None}
    widened: dict[tuple, Route] = {}

    def widen(param: nn.Parameter, where: Route | None) -> Route | None:
        holder = copies.get(id(param))
        if holder is None:
            return where
        key = ("tied", where.key if where is not None else None)
        if key not in widened:
            widened[key] = _widen(where, holder, param)
        return widened[key]

    def static(param: nn.Parameter) -> Route | None:
        return widen(param, average.static(param) if average is not None else None)

    def route(param: nn.Parameter) -> tuple[Route | None, torch.Tensor]:
        if base is None:
            return static(param), param.grad
        where, local = base(param)
        return widen(param, where), local

    if base is None:
        route.static = static
    return route


def _widen(where: Route | None, tied: Tied, param: nn.Parameter) -> Route:
    """`where` (the reduction over this stage's ranks; None: none) widened to every rank that holds a copy of
    `param`: the same scale (the copies are summed, the replicas averaged as before) and write-back."""
    assert tied.group is not None
    inside = dist.get_world_size(where.group) if where is not None else 1
    if dist.get_world_size(tied.group) != tied.holders * inside:
        raise RuntimeError(
            f"the tied parameter {tuple(param.shape)} is reduced over {inside} ranks of its stage, but the "
            f"ranks holding its copies are {dist.get_world_size(tied.group)} for {tied.holders} holders: its "
            "gradient must be pending over the stage's data-parallel dims only (as a GPT's embedding is)"
        )
    if where is None:
        return Route(key=("tied",), group=tied.group, scale=1.0, finish=_write_local, copies=_copies(param))
    return Route(
        key=("tied", where.key), group=tied.group, scale=where.scale, finish=where.finish, copies=where.copies
    )


def _write_local(param: nn.Parameter, chunk: torch.Tensor) -> None:
    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
    local.copy_(chunk.view_as(local))


def _copies(param: nn.Parameter) -> int:
    """Ranks of the stage mesh that hold the same values as this rank's piece of `param` (1 for a plain
    tensor, whose replicas take part in the reduction)."""
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(param.placements) if p.is_replicate())
