"""The operator-level search over mesh shapes: any captured model on `gpus` devices (`loom plan --model
MODULE:FUNCTION`).

For each mesh shape dp x tp of the devices, the operator-level problem (`loom.plan.problem`) is built on the
cluster and solved (`solve_model`: the same path `loom.parallelize(mode="auto")` takes on a live mesh) under
the memory limit; the solutions are ranked by predicted step time (then memory). A mesh whose solution
cannot fit, or whose batch does not split over its dp ranks, is an infeasible region with the reason.

Searched: the mesh shape and every operator's and parameter's layout on it (data, tensor and ZeRO-3-like
parameter sharding all come out of the layouts). Not searched for such models: pipelines, recomputation,
optimizer levels (the memory counts Adam's states whole at each parameter's layout: `OPTIMIZER_COPIES`),
context parallelism and micro-batches (one step runs the whole batch); those are the outer search's, which
needs a transformer's shape (`loom.plan.outer`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate

from loom.cost.hardware import GIB, Cluster
from loom.files import byte_size
from loom.plan.graph import Graph
from loom.plan.outer_space import Infeasible, divisors
from loom.plan.plan import Plan
from loom.plan.problem import DTYPE_NAMES

__all__ = [
    "MeshSolution",
    "local_regions",
    "mesh_shapes",
    "model_flops",
    "search_meshes",
    "solve_model",
]


def local_regions(model: nn.Module) -> dict[str, Any]:
    """The module plan entries of the local regions the model's family recipe names (Mixtral's experts:
    their routing has data-dependent shapes, which DTensor cannot run): they run on each rank's own rows with
    their parameters whole, whatever the planner chose around them (`_whole_in_regions`)."""
    from loom.models.recipes import known_recipe

    recipe = known_recipe(model)
    plan = recipe.tensor_plan if recipe is not None else {}
    return {pattern: dict(entry) for pattern, entry in plan.items() if entry.get("local")}


def _in_regions(path: str, regions: Mapping[str, Any]) -> bool:
    """Whether `path` (a parameter's, or a module's with a trailing dot) lies inside a module of the local
    regions: the region module itself or any module within it, as a region runs them all on plain tensors."""
    parts = path.split(".")
    return any(fnmatchcase(".".join(parts[:n]), pattern) for pattern in regions for n in range(1, len(parts)))


def _whole_in_regions(problem: Any, regions: Mapping[str, Any]) -> dict[str, set[int]]:
    """Pins: every operator reads the local regions' parameters whole, as each rank runs a region on plain
    tensors. Where they are kept is the solver's choice: kept cut, a region's parameters are gathered when
    it starts and their gradients reduced back (`loom.parallel.local_region`), which the edges into their
    readers price, with the gathered copies kept for backward."""
    graph, decisions = problem.graph, problem.decisions
    kept = {
        problem.canon.get(p.node, p.node) for path, p in graph.params.items() if _in_regions(path, regions)
    }
    allowed: dict[str, set[int]] = {}
    for edge in problem.edges:
        reader = decisions[edge.target]
        if problem.canon.get(edge.ref.node, edge.ref.node) not in kept or reader.kind != "op":
            continue
        whole = {
            i
            for i, c in enumerate(reader.options)
            if all(isinstance(p, Replicate) for p in c.inputs[edge.index])
        }
        allowed[edge.target] = allowed.get(edge.target, set(range(len(reader.options)))) & whole
        if not allowed[edge.target]:
            raise ValueError(
                f"{edge.target} ({graph[edge.target].target}) in a local region has no candidate reading "
                f"{graph[edge.ref.node].target} whole on mesh {problem.mesh}; leave its module out of the local regions"
            )
    return allowed


def solve_model(
    model: nn.Module,
    graph: Graph,
    mesh: Mapping[str, int],
    cluster: Cluster | str,
    memory_limit: float | None = None,
    space: Any = None,
) -> tuple[Any, Plan]:
    """The operator-level solution of `model` (captured as `graph`) on `mesh`, priced on `cluster`, each
    device keeping at most `memory_limit` bytes when given, and its Plan: the local regions of the model's
    recipe read their parameters whole (`_whole_in_regions`) and join the Plan's strategies. Raises ValueError when no
    layout fits (the message says how much the most sharded layouts need). `space`: the graph's strategy space
    on `mesh`, when already made (`loom.plan.space.strategy_space`)."""
    from loom.plan.problem import build_problem
    from loom.plan.solve import solve

    problem = build_problem(graph, dict(mesh), cluster, space)
    regions = local_regions(model)
    pinned = _whole_in_regions(problem, regions) if regions else None
    solution = solve(problem, pinned=pinned, memory_limit=memory_limit)
    plan = solution.plan()
    if regions:  # a region gathers its parameters and lays its outputs out itself: no other entry moves them
        computed = {
            path: spec for path, spec in plan.compute_layouts.items() if not _in_regions(path, regions)
        }
        strategies = {
            key: entry for key, entry in plan.strategies.items() if not _in_regions(key + ".", regions)
        }
        plan = plan.replace(strategies={**strategies, **regions}, compute_layouts=computed)
    return solution, plan


def mesh_shapes(gpus: int) -> list[dict[str, int]]:
    """Every dp x tp mesh of `gpus` devices, data parallel first; axes of size 1 are left out (a plan's
    absent axis is 1), one device is `{"dp": 1}`."""
    shapes = []
    for tp in divisors(gpus):
        shape = {axis: size for axis, size in (("dp", gpus // tp), ("tp", tp)) if size > 1}
        shapes.append(shape or {"dp": 1})
    return shapes


def region(mesh: Mapping[str, int]) -> str:
    """A mesh as the search names it: "dp=2 tp=4" (an absent axis is 1)."""
    return f"dp={mesh.get('dp', 1)} tp={mesh.get('tp', 1)}"


def model_flops(graph: Graph) -> tuple[float, str]:
    """Flops of one training step (forward and backward, the whole model) and the dtype most parameter
    elements have (fp32, bf16, fp16), whose peak an MFU is taken against."""
    flops = graph.total("flops") + graph.total("flops", backward=True)
    sizes: Counter[str] = Counter()
    for param in graph.params.values():
        sizes[DTYPE_NAMES.get(param.info.dtype, "fp32")] += math.prod(param.info.shape)
    return float(flops), (sizes.most_common(1)[0][0] if sizes else "fp32")


@dataclass(frozen=True)
class MeshSolution:
    """One mesh shape's operator-level solution: `mesh` (axis sizes), the solver's `solution`, its `plan`
    (a `loom.plan.Plan`, with its predicted step time and memory) and the MFU (None without flops)."""

    mesh: dict[str, int]
    solution: Any
    plan: Plan
    mfu: float | None
    reserved_bytes: float = 0.0  # the device's memory no model can use (`Device.reserved_gib`)

    @property
    def step_s(self) -> float:
        """Predicted step time: compute and communication of the whole model (`Solution.cost_s`)."""
        return self.solution.cost_s

    @property
    def memory_gib(self) -> float:
        """Predicted memory per device, as `loom simulate` counts it: parameter states at their layouts,
        activations kept for backward, and the device's reserved memory (runtime context, allocator slack)."""
        return (self.solution.memory_bytes + self.reserved_bytes) / GIB

    @property
    def reserved_gib(self) -> float:
        """The device's reserved memory within `memory_gib`."""
        return self.reserved_bytes / GIB

    @property
    def region(self) -> str:
        """The mesh as the search names it ("dp=2 tp=4")."""
        return region(self.mesh)

    def redistributions(self) -> list[dict[str, Any]]:
        """The collectives the chosen layouts insert, grouped by direction, kind and mesh axis: count, bytes
        and seconds (each edge of block 0 once, as `Solution.collectives` lists them)."""
        groups: dict[tuple[str, str, str], dict[str, Any]] = {}
        for _, direction, step in self.solution.collectives():
            key = (direction, step.kind, step.axis)
            entry = groups.setdefault(
                key,
                {
                    "direction": direction,
                    "kind": step.kind,
                    "axis": step.axis,
                    "count": 0,
                    "bytes": 0.0,
                    "seconds": 0.0,
                },
            )
            entry["count"] += 1
            entry["bytes"] += step.nbytes
            entry["seconds"] += step.seconds
        return sorted(groups.values(), key=lambda e: -e["seconds"])


def search_meshes(
    model: nn.Module,
    graph: Graph,
    cluster: Cluster,
    gpus: int,
    memory_limit: float | None = None,
) -> Any:
    """Solve `model` (captured as `graph` at one step's whole batch) on every dp x tp mesh of `gpus`
    devices of `cluster`, each device under `memory_limit` bytes (default: its memory; the device's reserved
    memory counts against it, as in `loom simulate`); a `SearchResult` of `MeshSolution`s, fastest first,
    and the infeasible meshes with their reason."""
    from loom.plan.outer import SearchResult
    from loom.plan.solve import NoLayoutFits
    from loom.plan.space import strategy_space

    start = time.perf_counter()
    cluster = cluster.with_size(gpus, cluster.gpus_per_node)
    limit = memory_limit if memory_limit is not None else cluster.device.memory_gib * GIB
    reserved = cluster.device.reserved_gib * GIB
    flops, dtype = model_flops(graph)
    peak = cluster.device.peak(dtype) * gpus
    found, infeasible = [], []
    shapes = mesh_shapes(gpus)
    asked: dict = {}  # DTensor's answers per operator and axis size, shared by every mesh's space
    for mesh in shapes:
        reason = _unsplit_batch(graph, mesh.get("dp", 1)) or _no_room(limit, reserved)
        if reason is None:
            try:
                space = strategy_space(graph, mesh, cache=asked)
                solution, plan = solve_model(model, graph, mesh, cluster, limit - reserved, space)
            except NoLayoutFits as error:
                reason = (
                    f"no layout fits {byte_size(limit)} per device: the most sharded layouts need "
                    f"{byte_size(error.least + reserved)} with the device's reserved {byte_size(reserved)}; "
                    "raise --memory-limit or --gpus"
                )
            except ValueError as error:
                reason = str(error)
        if reason is not None:
            infeasible.append(Infeasible(region(mesh), reason))
            continue
        mfu = flops / solution.cost_s / peak if flops and solution.cost_s > 0 else None
        found.append(MeshSolution(mesh=mesh, solution=solution, plan=plan, mfu=mfu, reserved_bytes=reserved))
    found.sort(key=lambda c: (c.step_s, c.memory_gib))
    return SearchResult(
        candidates=found, infeasible=infeasible, memory_limit_gib=limit / GIB, considered=len(shapes),
        simulated=len(found), seconds=time.perf_counter() - start,
    )  # fmt: skip


def _no_room(limit: float, reserved: float) -> str | None:
    """Why no model fits under `limit` bytes when the device reserves `reserved` of them, or None."""
    if limit > reserved:
        return None
    return (
        f"the memory limit {byte_size(limit)} leaves nothing beyond the device's reserved {byte_size(reserved)} "
        "(runtime context, allocator slack): raise --memory-limit"
    )


def _unsplit_batch(graph: Graph, dp: int) -> str | None:
    """Why the model's inputs cannot be split over `dp` ranks by rows (dim 0), or None when they can."""
    for node in graph.nodes:
        info = node.output(0) if node.kind == "input" else None
        if info is not None and info.ndim and info.shape[0] % dp:
            return (
                f"input {graph.arguments.get(node.name) or node.name} has {info.shape[0]} rows, which do not "
                f"split over dp={dp}; give --global-batch a multiple of {dp}"
            )
    return None
