"""Where each parameter's gradient is reduced, for `GradSync`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from loom.dist.mesh import Mesh
from loom.parallel.grad_sync import Route


def data_parallel_route(group: dist.ProcessGroup | None = None):
    """Plain data parallelism: average every gradient over `group` (all ranks by default)."""
    size = dist.get_world_size(group)

    def write_back(param: nn.Parameter, chunk: torch.Tensor) -> None:
        param.grad.copy_(chunk.view_as(param.grad))

    route = Route(key=("average",), group=group, scale=1.0 / size, finish=write_back)

    def route_of(param: nn.Parameter) -> tuple[Route, torch.Tensor]:
        return route, param.grad

    route_of.static = lambda _param: route  # every gradient goes here: buckets can be fixed before backward
    return route_of


def dtensor_route(mesh: Mesh):
    """DTensor parameters: sum each gradient's pending (Partial) parts over the mesh dims that hold them.

    A gradient that is partial over a run of consecutive canonical mesh dims is reduced by one bucketed
    all-reduce over their flattened group; any other mismatch with the parameter's placements is left to
    `fix_placements`, which DTensor redistributes after backward.
    """
    routes: dict[tuple, Route] = {}

    def route(param: nn.Parameter) -> tuple[Route | None, torch.Tensor]:
        grad = _like_parameter(param)
        assert isinstance(grad, DTensor), "parameters of a semi_auto model are DTensors"
        partial = tuple((i, p.reduce_op) for i, p in enumerate(grad.placements) if isinstance(p, Partial))
        dims = tuple(i for i, _ in partial)
        ops = {op for _, op in partial}
        consecutive = dims == tuple(range(dims[0], dims[0] + len(dims))) if dims else False
        if not consecutive or len(ops) != 1 or ops - {"sum", "avg"}:
            return None, grad.to_local()
        # Buckets also group by how many ranks hold each value (replication over the other mesh dims), so
        # that a bucket's elements are counted alike when norms are summed over sharded gradients.
        copies = math.prod(
            grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate()
        )
        key = (dims, ops.pop(), copies)
        if key not in routes:
            sub_mesh = mesh.sub_mesh(dims)
            scale = 1.0 / sub_mesh.size() if key[1] == "avg" else 1.0
            routes[key] = Route(
                key=key, group=sub_mesh.get_group(), scale=scale, finish=_replicate_dims(dims), copies=copies
            )
        return routes[key], grad.to_local()

    return route


def _like_parameter(param: nn.Parameter) -> torch.Tensor:
    """`param.grad` cut as the parameter is, keeping only the pending sums over mesh dims where the
    parameter is replicated (the data-parallel replicas' parts, which the buckets reduce).

    Backward may leave a gradient whole, or pending, along a dim where its parameter is cut (a
    vocabulary-parallel head's gradient pending over "tp"); its local piece then has another size than the
    parameter's, which optimizer levels 1-3 cut into chunks. Bringing it to the parameter's cut now is a
    reduce-scatter (or a local slice) over that dim, and less to reduce afterwards."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    target = tuple(
        g if g.is_partial() and p.is_replicate() else p
        for g, p in zip(grad.placements, param.placements, strict=True)
    )
    if target != tuple(grad.placements):
        param.grad = grad = grad.redistribute(grad.device_mesh, target)
    return grad


def _replicate_dims(dims: tuple[int, ...]):
    def finish(param: nn.Parameter, chunk: torch.Tensor) -> None:
        grad = param.grad
        local = grad.to_local()
        local.copy_(chunk.view_as(local))
        placements = [Replicate() if i in dims else p for i, p in enumerate(grad.placements)]
        param.grad = DTensor.from_local(
            local, grad.device_mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )

    return finish


def fix_placements(params: list[nn.Parameter]):
    """After backward: give every DTensor gradient its parameter's placements (DTensor redistributes)."""

    def fix() -> None:
        with torch.no_grad():
            for param in params:
                grad = param.grad
                if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
                    param.grad = grad.redistribute(param.device_mesh, param.placements)

    return fix
