"""`loom plan --model MODULE:FUNCTION`: any PyTorch model a Python function builds, captured at the
operator level and solved on every dp x tp mesh of the devices (`loom.plan.mesh_search`)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from loom.cli.plan import ONE_MODEL, _json, _print_infeasible, _print_runners_up
from loom.cli.simulate import _duration
from loom.cost.hardware import GIB, get_cluster
from loom.files import byte_size
from loom.plan.mesh_search import MeshSolution
from loom.plan.outer import SearchResult

NOT_SEARCHED = (
    "not searched for a Python model: pipelines, recomputation, optimizer levels (Adam's states are counted "
    "whole at each parameter's layout), context parallelism and micro-batches"
)


def _check(args: argparse.Namespace) -> None:
    """The options a Python model takes; a ValueError names the option and the fix."""
    if args.config or args.model_config:
        raise ValueError(ONE_MODEL)
    if args.gpus is None:
        raise ValueError("--gpus is missing: give the devices to plan for, e.g. --gpus 8")
    if args.seq is not None:
        raise ValueError(
            f"--seq does not apply to --model {args.model}: its example inputs give the shapes (set --global-batch "
            f"for the rows, dim 0 of every input)"
        )
    if args.memory_limit is not None and args.memory_limit <= 0:
        raise ValueError(f"--memory-limit {args.memory_limit:g} must be > 0 GiB per device")


def _search(args: argparse.Namespace) -> tuple[SearchResult, str]:
    """Build, capture and search; the result and the cluster's name. ValueErrors (bad options, a spec that
    does not load, a model that cannot be captured) name the cause."""
    from loom.plan.capture import CaptureError, capture  # torch.export and scipy only when asked
    from loom.plan.mesh_search import search_meshes
    from loom.plan.model_spec import build_model

    _check(args)
    cluster = get_cluster(args.hardware, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    built = build_model(args.model, args.global_batch)
    try:
        graph = capture(built.model, built.args, built.kwargs)
    except CaptureError as error:
        raise ValueError(f"--model {args.model!r}: {error}") from None
    limit = args.memory_limit * GIB if args.memory_limit is not None else None
    return search_meshes(built.model, graph, cluster, args.gpus, limit), cluster.name


def describe(c: MeshSolution) -> str:
    """One line: the mesh, and the solver's optimality gap when it stopped short of proving the optimum."""
    gap = c.solution.gap
    return c.region + (f" (within {gap:.1%} of optimal)" if gap > 0 else "")


def _fields(c: MeshSolution) -> dict:
    s = c.solution
    return {
        "mesh": c.mesh,
        "step_s": c.step_s,
        "compute_s": s.compute_s,
        "comm_s": s.comm_s,
        "memory_gib": c.memory_gib,
        "mfu": c.mfu,
        "gap": s.gap,
        "method": s.method,
        "redistributions": c.redistributions(),
        "plan": c.plan.to_dict(),
    }


def print_mesh_search(console: Console, spec: str, found: SearchResult, top: int) -> None:
    """The best mesh with its layouts, redistributions, step time, MFU and memory, the `top` runners-up and
    why each lost, the infeasible meshes, and what is not searched."""
    best = found.best
    s = best.solution
    mfu = f", MFU {best.mfu:.1%}" if best.mfu is not None else ""
    console.print(f"[bold]{spec}[/]: best plan {best.region}", highlight=False)
    console.print(
        f"  step {_duration(best.step_s)} (compute {_duration(s.compute_s)}, communication {_duration(s.comm_s)})"
        f"{mfu}, memory {byte_size(best.memory_gib * GIB)} per device (limit {byte_size(found.memory_limit_gib * GIB)})",
        highlight=False,
        soft_wrap=True,
    )
    moves = best.redistributions()  # each edge priced again: once
    _print_layouts(console, best, bool(moves))
    for entry in moves:
        console.print(
            f"    {entry['direction']} {entry['kind']} over {entry['axis']}: {entry['count']} x, "
            f"{byte_size(entry['bytes'])} in all, {_duration(entry['seconds'])}",
            highlight=False,
        )
    _print_runners_up(console, found, top, describe)
    _print_infeasible(console, found)
    console.print(NOT_SEARCHED, highlight=False)
    console.print(
        f"solved {found.simulated} of {found.considered} meshes in {found.seconds:.1f} s", highlight=False
    )


def _print_layouts(console: Console, best: MeshSolution, moves: bool) -> None:
    """The parameters' layouts (a repeated block's as `*`: block 0 stands for every block), those read in
    another layout than kept, the inputs moved, and the redistributions' heading."""
    plan = best.plan
    console.print(
        "  parameter layouts (cut ones; every other parameter is whole on every device):", highlight=False
    )
    for name, spec in plan.parameter_layouts.items() or [("(none)", "")]:
        computed = plan.compute_layouts.get(name)
        read = f", read as {computed}" if computed is not None else ""
        console.print(f"    {name} {spec}{read}", highlight=False)
    for name, spec in plan.input_layouts.items():
        console.print(f"  input {name} read as {spec}", highlight=False)
    if not moves:
        console.print("  no redistributions", highlight=False)
    else:
        console.print("  redistributions (each edge of block 0 once):", highlight=False)


def execute(args: argparse.Namespace) -> int:
    """`loom plan --model MODULE:FUNCTION`: search, print, write; the exit status (2: bad input, 1: nothing
    fits, 0: a plan)."""
    try:
        found, cluster = _search(args)
    except ValueError as error:
        print(f"loom plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_json(found, args.top, _fields)))  # considered: meshes; simulated: meshes solved
    if found.best is None:
        if not args.json:
            print(f"loom plan: no plan of {args.model} fits {args.gpus} x {cluster}:", file=sys.stderr)
            for item in found.infeasible:
                print(f"  {item.region}: {item.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print_mesh_search(Console(), args.model, found, args.top)
    if args.out:
        path = found.best.plan.save(args.out)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
