"""The operator-level solvers: pick one candidate per operator and one layout per parameter and input, at
the least predicted step time, optionally under a memory limit per device.

    solution = search(graph, {"dp": 2, "tp": 2}, cluster="h100-sxm", memory_limit=40 * 2**30)
    solution = propagate(graph, mesh, fixed={"mlp.fc1": {"parameter_plan": {"weight": ["tp", "None"]}}})
    solution.cost_s, solution.gap, solution.layout("fc2.weight"), solution.plan()

Both solve one problem (`loom.plan.problem` builds its terms): exactly by dynamic programming when its
decisions form a forest and no memory limit applies (`loom.plan.tree`), else as an integer program with
HiGHS, through `scipy.optimize.milp`: a binary per option of every decision (exactly one chosen), and per edge a
continuous variable per pair (producer output layout, consumer requirement) whose marginals equal the two
sides' choices. With binary choices the pair variables are exact; their LP relaxation is the local
polytope, tight on chains and trees. `propagate` (MindSpore's `sharding_propagation`) is `search` with
the fixed operators and parameters pinned.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from loom.cost.hardware import Cluster
from loom.files import byte_size
from loom.plan.dispatch import Mismatch, dispatch_mismatches
from loom.plan.graph import Graph
from loom.plan.problem import Problem, build_problem, carries_gradient, requirement
from loom.plan.redistribute import Step, gradient_layouts, redistribution
from loom.plan.space import Placements, StrategySpace
from loom.plan.to_plan import pins, solution_plan
from loom.plan.tree import tree_choice

__all__ = ["NoLayoutFits", "Solution", "propagate", "search", "solve"]

# HiGHS's tolerances are absolute (about 1e-7): seconds (1e-6 for a small collective) and bytes (1e9) would
# drown in them, so the program counts microseconds and GiB.
US, GIB = 1e6, 2.0**30

MAX_ROUNDS = 8
"""The most solves of one integer program with `solve`'s `dispatched`: each round after the first adds
the operators DTensor would run otherwise than chosen (`loom.plan.dispatch`) as constraints."""


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The chosen option of every decision (`choice`: node name -> option index), with the predicted step
    time (`cost_s`: compute plus communication, whole model), its parts, the lower bound (`bound_s`) and
    the relative optimality `gap`, memory per device, how it was found (`method`: "tree" or "milp"), the
    solver's status message, and how many solves it took (`rounds`: more than 1 with `solve`'s
    `dispatched`)."""

    problem: Problem
    choice: dict[str, int]
    cost_s: float
    compute_s: float
    comm_s: float
    bound_s: float
    gap: float
    memory_bytes: float
    method: str
    status: str
    rounds: int = 1

    def option(self, name: str) -> Any:
        """The chosen candidate of operator `name`, or the chosen placements of source `name`."""
        decision = self.problem.decisions[name]
        return decision.options[self.choice[name]]

    def layout(self, parameter: str) -> Placements:
        """The placements chosen for a parameter (by path, as `graph.params` names it)."""
        param = self.problem.graph.params.get(parameter)
        node = self.problem.canon.get(param.node, param.node) if param is not None else None
        if node not in self.choice:
            raise KeyError(f"{parameter!r} is not a parameter the solution lays out; see graph.params")
        return self.option(node)

    def collectives(self) -> list[tuple[str, str, Step]]:
        """The collectives of the chosen layouts: (edge `producer -> consumer`, direction, step), for every
        edge where the tensor moves (weights of repeated blocks aside: each edge of block 0 once)."""
        found = []
        problem = self.problem
        for edge in problem.edges:
            producer, consumer = problem.decisions[edge.ref.node], problem.decisions[edge.target]
            picked = producer.options[self.choice[edge.ref.node]]
            out = picked.outputs[edge.ref.index] if producer.kind == "op" else picked
            required, split = requirement(consumer, self.choice[edge.target], edge.index, problem.mesh)
            where = f"{edge.ref!r} -> {edge.target}"
            for step in redistribution(edge.tensor.nbytes, out, required, problem.mesh, problem.cluster):
                found.append((where, "forward", step))
            if carries_gradient(problem.graph, edge.ref, edge.target):
                left, wanted = gradient_layouts(out, required, split)
                for step in redistribution(edge.tensor.nbytes, left, wanted, problem.mesh, problem.cluster):
                    found.append((where, "backward", step))
        return found

    def predicted_collectives(
        self, *, device: str = "cuda", bucket_mb: float = 25.0, full_batch: bool = False
    ) -> list:
        """The collectives one training step of the chosen plan issues on one rank, as `StepCollective`s
        (`loom.plan.step`: the priced redistributions of every block, the parameters' gradients as
        `GradSync` reduces them, the even-batch check and the agreement); `device` the ranks compute on,
        `bucket_mb` and `full_batch` as given to `loom.parallelize`."""
        from loom.plan.step import predicted_collectives

        return predicted_collectives(self, device=device, bucket_mb=bucket_mb, full_batch=full_batch)

    def plan(self) -> Any:
        """The chosen layouts as a `loom.plan.Plan` that `loom.parallelize(model, plan=...)` applies."""
        return solution_plan(self)


def search(
    graph: Graph,
    mesh: Mapping[str, int],
    cluster: Cluster | str = "h100-sxm",
    *,
    memory_limit: float | None = None,
    space: StrategySpace | None = None,
    time_limit: float = 60.0,
    gap: float = 1e-4,
) -> Solution:
    """The full search: every operator's candidate and every parameter's layout at the least predicted
    step time on `cluster`, each device keeping at most `memory_limit` bytes (parameters, gradients and
    optimizer states at their layouts, and activations kept for backward) when given."""
    return solve(
        build_problem(graph, mesh, cluster, space), memory_limit=memory_limit, time_limit=time_limit, gap=gap
    )


def propagate(
    graph: Graph,
    mesh: Mapping[str, int],
    fixed: Mapping[str, Mapping[str, Any]],
    cluster: Cluster | str = "h100-sxm",
    *,
    memory_limit: float | None = None,
    space: StrategySpace | None = None,
    time_limit: float = 60.0,
) -> Solution:
    """Sharding propagation: the strategies of a few modules (or operators) are given, as a Plan's
    `strategies` entries (`{"parameter_plan": {"weight": ["tp", "None"]}, "in_strategy": [...]}`, keyed by
    module path pattern or op node name); every other operator takes the candidate of least total cost
    consistent with them."""
    problem = build_problem(graph, mesh, cluster, space)
    return solve(problem, pinned=pins(problem, fixed), memory_limit=memory_limit, time_limit=time_limit)


def solve(
    problem: Problem,
    *,
    pinned: Mapping[str, set[int]] | None = None,
    memory_limit: float | None = None,
    time_limit: float = 60.0,
    gap: float = 1e-4,
    method: str = "auto",
    dispatched: bool = False,
    unchecked: frozenset[str] = frozenset(),
) -> Solution:
    """Solve `problem`: by dynamic programming when its decisions form a forest and no memory limit is
    given or the forest's optimum fits under it (exact, `method="tree"`: the unconstrained optimum, when it
    fits, is the constrained one), else with HiGHS (`method="milp"`; `method="milp"` asks for it always);
    `pinned` restricts some decisions to some options. Raises `NoLayoutFits` when even the most sharded
    layouts exceed `memory_limit`.

    With `dispatched`, the integer program is solved again (at most `MAX_ROUNDS` times) until every
    operator, `unchecked` ones aside (a local region's, run on plain tensors), takes the candidate
    DTensor's dispatcher runs for the layouts that reach it (`loom.plan.dispatch`): each round adds the
    operators that ran otherwise as constraints. The solution's `rounds` and `status` say how many solves
    it took; where the constraints leave no plan, the first solve's stands (its status says so)."""
    if method not in ("auto", "milp"):
        raise ValueError(f"solve: method {method!r} is not one of 'auto', 'milp'")
    pinned = pinned or {}
    choice = tree_choice(problem, pinned) if method == "auto" else None
    if choice is not None:
        total = _total(problem, choice)
        tree = _solution(
            problem, choice, total, total, 0.0, "tree", "exact dynamic programming over a forest"
        )
        if memory_limit is None or tree.memory_bytes <= memory_limit:
            return tree
    cost, lower, upper, integral, rows, offsets, pair_offsets = _program(problem, pinned)
    constraints = [LinearConstraint(*rows)]
    if memory_limit is not None:
        memory = np.zeros(len(cost))
        for name, decision in problem.decisions.items():
            memory[offsets[name] : offsets[name] + len(decision.options)] = decision.memory
        for edge, first in zip(problem.edges, pair_offsets, strict=True):
            if edge.memory:
                memory[first : first + len(edge.producer) * len(edge.consumer)] = np.ravel(edge.memory)
        constraints.append(LinearConstraint(memory[None, :] / GIB, -np.inf, memory_limit / GIB))

    def run(extra: list[LinearConstraint]) -> Any:
        return milp(cost * US, integrality=integral, bounds=Bounds(lower, upper), constraints=constraints + extra,
                    options={"time_limit": time_limit, "mip_rel_gap": gap})  # fmt: skip

    result = run([])
    if result.x is None:
        least = None
        if memory_limit is not None:  # the least memory any plan needs, its kept copies included
            fewest = milp(memory / GIB, integrality=integral, bounds=Bounds(lower, upper), constraints=constraints[:1],
                          options={"time_limit": time_limit})  # fmt: skip
            least = fewest.fun * GIB if fewest.x is not None else None
        _raise_infeasible(memory_limit, pinned, result.message, least)
    found = _milp_solution(problem, result, offsets, 1, 0.0)
    return _dispatched_rounds(found, run, offsets, len(cost), frozenset(unchecked)) if dispatched else found


def _dispatched_rounds(found: Solution, run, offsets: dict[str, int], columns: int, unchecked) -> Solution:
    """`found` solved again by `run` (the integer program with extra constraints) until its operators run
    as DTensor's dispatcher runs them (`solve`'s `dispatched`), at most `MAX_ROUNDS` solves in all."""
    started, mismatches, seen, first = time.perf_counter(), [], set(), found
    for rounds in range(2, MAX_ROUNDS + 1):
        # the first round's single-input operators (views, most pointwise ones) are settled for every layout
        # their producer may give: cheap to ask, and otherwise the solver moves on to them round by round
        new = [m for m in dispatch_mismatches(found, unchecked, every=rounds == 2) if m not in seen]
        if not new:
            break
        mismatches += new
        seen.update(new)
        result = run([_cuts(mismatches, offsets, columns)])
        if result.x is None:  # the constraints leave no plan (under a memory limit): the first one stands
            return dataclasses.replace(first, status=f"{first.status}; round {rounds}: {result.message}")
        found = _milp_solution(problem=found.problem, result=result, offsets=offsets, rounds=rounds,
                               seconds=time.perf_counter() - started)  # fmt: skip
    return found


def _milp_solution(
    problem: Problem, result: Any, offsets: dict[str, int], rounds: int, seconds: float
) -> Solution:
    """The solution HiGHS found (`result`), in the `rounds`-th solve (`seconds` of rounds after the
    first)."""
    choice = {
        name: int(np.argmax(result.x[offsets[name] : offsets[name] + len(d.options)]))
        for name, d in problem.decisions.items()
    }
    total = _total(problem, choice)
    bound = getattr(result, "mip_dual_bound", None)
    bound = total if bound is None or not math.isfinite(bound) else min(total, bound / US)
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    status = (
        result.message
        if rounds == 1
        else f"{result.message}; {rounds} rounds, {seconds:.1f} s after the first"
    )
    return _solution(problem, choice, total, bound, gap, "milp", status, rounds)


def _cuts(mismatches: list[Mismatch], offsets: dict[str, int], columns: int) -> LinearConstraint:
    """One row per mismatch: when its deciding decisions take the options that made the arriving layouts,
    the operator takes one of the options DTensor runs there (sum of the givens - sum of the allowed <=
    givens - 1). A row forbids only one combination of the givens, but under a memory limit the rows
    together may forbid every plan that fits (`solve` then keeps the last plan)."""
    data, row_ids, col_ids = [], [], []
    for row, mismatch in enumerate(mismatches):
        weights: dict[int, float] = defaultdict(float)
        for name, group in mismatch.given:
            for o in group:
                weights[offsets[name] + o] += 1.0
        for o in mismatch.allowed:
            weights[offsets[mismatch.op] + o] -= 1.0
        for column, value in weights.items():
            data.append(value), row_ids.append(row), col_ids.append(column)
    matrix = coo_array((data, (row_ids, col_ids)), shape=(len(mismatches), columns)).tocsr()
    upper = np.array([len(m.given) - 1.0 for m in mismatches])
    return LinearConstraint(matrix, -np.inf, upper)


def _solution(problem, choice, total, bound, gap, method, status, rounds=1) -> Solution:
    compute = sum(d.cost[choice[name]] for name, d in problem.decisions.items())
    return Solution(
        problem=problem,
        choice=choice,
        cost_s=total,
        compute_s=compute,
        comm_s=total - compute,
        bound_s=bound,
        gap=gap,
        memory_bytes=_memory(problem, choice),
        method=method,
        status=status,
        rounds=rounds,
    )


def _memory(problem: Problem, choice: Mapping[str, int]) -> float:
    """Bytes per device of the chosen options and of the copies their edges keep for backward."""
    total = sum(d.memory[choice[name]] for name, d in problem.decisions.items())
    for edge in problem.edges:
        if edge.memory:
            out, need = _groups(edge, choice)
            total += edge.memory[out][need]
    return total


def _groups(edge: Any, choice: Mapping[str, int]) -> tuple[int, int]:
    """The producer and consumer groups of `edge` that `choice` takes."""
    out = next(g for g, (_, options) in enumerate(edge.producer) if choice[edge.ref.node] in options)
    need = next(g for g, (_, options) in enumerate(edge.consumer) if choice[edge.target] in options)
    return out, need


def _total(problem: Problem, choice: Mapping[str, int]) -> float:
    """Seconds of the chosen options and of the edges between them."""
    total = sum(d.cost[choice[name]] for name, d in problem.decisions.items())
    for edge in problem.edges:
        out, need = _groups(edge, choice)
        total += edge.cost[out][need]
    return total


def _program(problem: Problem, pinned: Mapping[str, set[int]]):
    """The objective, bounds, integrality and equality rows of the integer program, each decision's first
    column, and each edge's first pair column."""
    cost: list[float] = []
    upper: list[float] = []
    offsets: dict[str, int] = {}
    data, row_ids, col_ids = [], [], []
    row = 0

    def put(r: int, c: int, v: float) -> None:
        data.append(v), row_ids.append(r), col_ids.append(c)

    for name, decision in problem.decisions.items():
        offsets[name] = len(cost)
        allowed = pinned.get(name)
        cost += decision.cost
        upper += [1.0 if allowed is None or i in allowed else 0.0 for i in range(len(decision.options))]
        for i in range(len(decision.options)):
            put(row, offsets[name] + i, 1.0)
        row += 1
    integral = [1] * len(cost)
    pair_offsets = []
    for edge in problem.edges:
        first = len(cost)
        pair_offsets.append(first)
        n_in = len(edge.consumer)
        for i in range(len(edge.producer)):
            # a pair priced infinite never runs (a convolution's refused arrival, a pair DTensor's dispatcher
            # would not run: `problem.settled_by_dispatcher`): its column is bounded at 0
            cost += [c if math.isfinite(c) else 0.0 for c in edge.cost[i]]
            upper += [1.0 if math.isfinite(c) else 0.0 for c in edge.cost[i]]
        integral += [0] * (len(cost) - first)
        # each producer group's pairs sum to that group's choice, each consumer group's likewise
        for i, (_, options) in enumerate(edge.producer):
            for j in range(n_in):
                put(row, first + i * n_in + j, 1.0)
            for o in options:
                put(row, offsets[edge.ref.node] + o, -1.0)
            row += 1
        for j, (_, options) in enumerate(edge.consumer):
            for i in range(len(edge.producer)):
                put(row, first + i * n_in + j, 1.0)
            for o in options:
                put(row, offsets[edge.target] + o, -1.0)
            row += 1
    matrix = coo_array((data, (row_ids, col_ids)), shape=(row, len(cost))).tocsr()
    target = np.zeros(row)
    target[: len(problem.decisions)] = 1.0
    return (
        np.array(cost),
        np.zeros(len(cost)),
        np.array(upper),
        np.array(integral),
        (matrix, target, target),
        offsets,
        pair_offsets,
    )


class NoLayoutFits(ValueError):
    """No layout of a problem fits its memory limit: even the most sharded layouts need `least` bytes per
    device against `limit`. The message gives the library's remedies; a caller with other knobs (the
    command line's options) words its own from `limit` and `least`."""

    def __init__(self, limit: float, least: float) -> None:
        self.limit, self.least = limit, least
        super().__init__(
            f"no layout fits {byte_size(limit)} per device: the most sharded layouts still need "
            f"{byte_size(least)}; raise memory_limit, use a larger mesh, or recompute activations"
        )


def _raise_infeasible(memory_limit, pinned, message: str, least: float | None) -> None:
    """`NoLayoutFits` when the least memory any plan needs (`least`, bytes) exceeds `memory_limit`; else
    the integer program's own reason, with the pinned decisions that may explain it."""
    if memory_limit is not None and least is not None and least > memory_limit * (1 + 1e-9):
        raise NoLayoutFits(memory_limit, least)
    raise ValueError(
        f"the planner's integer program has no solution ({message}); pinned decisions: {sorted(pinned)}"
    )
