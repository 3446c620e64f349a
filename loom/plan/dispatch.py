"""What DTensor's dispatcher runs where no hook of loom's moves a tensor, for a chosen solution.

A plan moves tensors only at a few places: a module's `in_strategy` and `out_strategy` (its one input
from outside, its output), a parameter's compute layout, a model input's layout. Everywhere else (between
two operators of one module, into a module without a hook) a tensor reaches its reader as its producer
made it, and DTensor's dispatcher picks the reader's strategy itself: of the strategies its rule offers,
the one of least redistribution cost (DTensor's own `redistribute_cost`) from the layouts that arrive. The
solver chooses and prices a candidate per operator by loom's own costs; where the two differ, what runs is
not what was priced.

`dispatch_mismatches` replays the dispatcher at every operator of a solution from the layouts that arrive
(`loom.plan._dtensor_rules.dispatch`, the entry DTensor's dispatcher calls) and returns each operator whose
chosen candidate differs from DTensor's choice, as a `Mismatch`: the decisions whose chosen options made
the arriving layouts (each as the group of its options that make the same layout) and the operator's
options that run as DTensor would run them there. `loom.plan.solve` adds each as a constraint (those
producers' layouts imply one of those options) and solves again, until the solution runs as priced.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from loom.plan import _dtensor_rules
from loom.plan.opcost import meta_tensor
from loom.plan.space import Placements
from loom.plan.specs import MESH_AXES
from loom.plan.to_plan import placements as spec_placements

__all__ = ["NOT_DISPATCHED", "Mismatch", "dispatch_mismatches"]

NOT_DISPATCHED = frozenset({"aten._log_softmax.default", "aten.nll_loss_forward.default"})
"""Operators a plan does not hand to DTensor's dispatcher: `F.cross_entropy`, run as loom's
`local_cross_entropy` (`loom.parallel.lift`) on each rank's pieces."""


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """Operator `op` chose a candidate DTensor would not run: when every decision in `given` takes one of
    the options listed with it (the layouts that arrived), DTensor runs one of `allowed` (the operator's
    options equal to its choice; empty when loom has no such candidate)."""

    op: str
    given: tuple[tuple[str, frozenset[int]], ...]
    allowed: frozenset[int]


def dispatch_mismatches(
    solution: Any, skip: frozenset[str] = frozenset(), every: bool = False
) -> list[Mismatch]:
    """The operators of `solution` whose chosen candidate is not what DTensor's dispatcher runs for the
    layouts that reach them (module notes), each with every other combination of arriving layouts where
    DTensor would run something else than some of its options (up to `MAX_ARRIVALS` combinations; past
    that, only the combination that arrived): one round of constraints then settles such an operator for
    every layout its producers may choose. `skip` names operators not to check (a local region's, run on
    plain tensors); with `every`, every operator of one input is settled so, whether it ran otherwise or
    not (cheap: one question per layout of its producer)."""
    problem = solution.problem
    if any(axis not in MESH_AXES for axis in problem.mesh):
        return []  # no Plan names such a mesh: nothing runs it
    hooks = _Hooks(solution, solution.plan())
    into: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for edge in problem.edges:
        if problem.decisions[edge.target].kind == "op":
            into[edge.target][edge.index].append(edge)
    found = []
    for name, by_index in into.items():
        chosen = problem.decisions[name].options[solution.choice[name]]
        node = problem.graph[name]
        if name in skip or node.target in NOT_DISPATCHED or chosen.source != "dtensor":
            continue
        if sorted(by_index) != list(range(len(node.inputs))):
            continue  # an input without an edge (not a tensor the solver lays out): not replayed
        for edges in itertools.product(*(by_index[i] for i in range(len(node.inputs)))):
            arrived = [hooks.arrival(edge) for edge in edges]
            if (every and len(edges) == 1) or _runs_otherwise(problem, name, solution.choice[name], arrived):
                found += _every_mismatch(problem, name, [hooks.alternatives(edge) for edge in edges], arrived)
    return found


MAX_ARRIVALS = 4096
"""Combinations of arriving layouts replayed per mismatched operator (and inputs read across blocks)."""


def _every_mismatch(problem: Any, name: str, alternatives: list[list], arrived: list) -> list[Mismatch]:
    """The mismatches of operator `name` over every combination of its inputs' `alternatives` (each a
    list of (layout, (decision, options))), or only the one that `arrived` when they are too many."""
    combinations = (
        [arrived]
        if math.prod(len(a) for a in alternatives) > MAX_ARRIVALS
        else itertools.product(*alternatives)
    )
    found = (_mismatch(problem, name, list(combination)) for combination in combinations)
    return [m for m in found if m is not None]


def _runs_otherwise(problem: Any, name: str, option: int, arrivals: list) -> bool:
    """Whether DTensor runs operator `name` otherwise than its `option` for `arrivals`."""
    chosen = problem.decisions[name].options[option]
    arrived = tuple(layout for layout, _ in arrivals)
    if _dtensor_rules.layouts_key(arrived) == _dtensor_rules.layouts_key(chosen.inputs):
        return False  # nothing moves: DTensor runs the strategy whose inputs arrive as they are
    choice = _dispatched(problem, problem.graph[name], arrived, tuple(problem.mesh.values()))
    return choice is not None and _key(choice) != _key(chosen)


def _mismatch(problem: Any, name: str, arrivals: list) -> Mismatch | None:
    """The constraint that operator `name` runs what DTensor runs for `arrivals` ((layout, (decision,
    options)) per input), or None where every option the givens leave is DTensor's choice (or DTensor
    refuses those layouts)."""
    decision, node = problem.decisions[name], problem.graph[name]
    given: dict[str, frozenset[int]] = {}
    for _, (decider, options) in arrivals:
        given[decider] = given.get(decider, options) & options
    if any(not options for options in given.values()):
        return None  # the givens contradict each other: no choice of theirs makes these arrivals
    choice = _dispatched(problem, node, tuple(layout for layout, _ in arrivals), tuple(problem.mesh.values()))
    if choice is None:
        return None
    allowed = frozenset(i for i, c in enumerate(decision.options) if _key(c) == _key(choice))
    left = given.get(name, frozenset(range(len(decision.options))))
    if left <= allowed:
        return None
    return Mismatch(op=name, given=tuple(sorted(given.items())), allowed=allowed)


def _key(candidate: Any) -> tuple:
    """A candidate's (or DTensor's answer's) input and output layouts, comparable (`layouts_key`)."""
    return _dtensor_rules.layouts_key(candidate.inputs), _dtensor_rules.layouts_key(candidate.outputs)


def _dispatched(problem: Any, node: Any, arriving: tuple[Placements, ...], sizes: tuple[int, ...]) -> Any:
    """DTensor's choice for `node` given the `arriving` layouts of its inputs (None: refused)."""
    infos = [problem.graph.tensor(ref) for ref in node.inputs]
    shapes = tuple((info.shape, info.stride, info.dtype) for info in infos)  # strides too: views read them
    key = (str(node.op), repr(node.skeleton()), shapes, repr(arriving), sizes)
    if key not in _ANSWERS:
        args, kwargs = node.call_args([meta_tensor(info) for info in infos])
        _ANSWERS[key] = _dtensor_rules.dispatch(node.op, args, kwargs, arriving, sizes)
    return _ANSWERS[key]


_ANSWERS: dict = {}  # DTensor's answers by operator, arguments, shapes, arriving layouts and mesh


class _Hooks:
    """Where the plan of a solution moves tensors: per edge, the layout that reaches the consumer and the
    decision (with the group of its options) that made that layout."""

    def __init__(self, solution: Any, plan: Any) -> None:
        self.solution, self.problem = solution, solution.problem
        self.graph, self.mesh = self.problem.graph, self.problem.mesh
        self.strategies = plan.strategies
        self.compute = plan.compute_layouts
        self.inputs = plan.input_layouts
        self._last = {}

    def arrival(self, edge: Any) -> tuple[Placements, tuple[str, frozenset[int]]]:
        """The layout `edge`'s tensor reaches its consumer in, and the decision whose options (the group
        of them) decide it: its producer, or the consumer itself where a hook moves the tensor to what
        the consumer's chosen option requires."""
        problem, solution = self.problem, self.solution
        producer = problem.decisions[edge.ref.node]
        option = solution.choice[edge.ref.node]
        made = (
            producer.options[option].outputs[edge.ref.index]
            if producer.kind == "op"
            else producer.options[option]
        )
        moved = self._moved(edge)
        if moved is None:
            group = next(frozenset(options) for layout, options in edge.producer if layout == made)
            return made, (edge.ref.node, group)
        # a hook decides: the consumer's chosen options that require what it moves the tensor to
        consumer = problem.decisions[edge.target]
        group = frozenset(i for i, c in enumerate(consumer.options) if c.inputs[edge.index] == moved)
        return moved, (edge.target, group or frozenset({solution.choice[edge.target]}))

    def alternatives(self, edge: Any) -> list[tuple[Placements, tuple[str, frozenset[int]]]]:
        """Every layout `edge`'s tensor may reach its consumer in, with the decision and options that make
        it: each layout of its producer's options where no hook moves it, else each layout the consumer's
        options require (the hook moves it there)."""
        if self._moved(edge) is None:
            return [(layout, (edge.ref.node, frozenset(options))) for layout, options in edge.producer]
        consumer = self.problem.decisions[edge.target]
        groups: dict[Placements, set[int]] = defaultdict(set)
        for i, option in enumerate(consumer.options):
            groups[option.inputs[edge.index]].add(i)
        return [(layout, (edge.target, frozenset(options))) for layout, options in groups.items()]

    def _moved(self, edge: Any) -> Placements | None:
        """The layout a hook of the plan moves `edge`'s tensor to (None: no hook moves it)."""
        graph, mesh = self.graph, self.mesh
        source, target = graph[edge.ref.node], graph[edge.target]
        info = graph.tensor(edge.ref)
        if source.kind == "parameter":
            spec = _matching(self.compute, source.target)
            return spec_placements(spec, info.ndim, mesh, source.target) if spec is not None else None
        if source.kind == "input":
            argument = graph.arguments.get(source.name)
            spec = self.inputs.get(argument) if argument else None
            return spec_placements(spec, info.ndim, mesh, source.target) if spec is not None else None
        if not source.is_op:
            return None
        moved = None
        for module in _enclosing(source.module):  # innermost first: an outer module's hook runs after
            if _contains(module, target.module) or self._last_op(module) != source.name:
                continue
            out = _matching(self.strategies, module, "out_strategy")
            if out is not None:
                moved = spec_placements(out[0], info.ndim, mesh, module)
        for module in reversed(_enclosing(target.module)):  # outermost first: its pre-hook runs first
            if _contains(module, source.module):
                continue
            into = _matching(self.strategies, module, "in_strategy")
            if into is not None:
                moved = spec_placements(into[0], info.ndim, mesh, module)
        return moved

    def _last_op(self, module: str) -> str | None:
        """The last operator of `module` among the decisions (its output, as `to_plan` reads it)."""
        if module not in self._last:
            inside = [
                n
                for n, d in self.problem.decisions.items()
                if d.kind == "op" and _contains(module, self.graph[n].module)
            ]
            self._last[module] = inside[-1] if inside else None
        return self._last[module]


def _matching(entries: Mapping[str, Any], path: str, key: str | None = None) -> Any:
    """The entry of `entries` (keyed by path pattern, a block index as `*`) for `path`, or its `key`."""
    for pattern, entry in entries.items():
        if fnmatchcase(path, pattern):
            return entry if key is None else entry.get(key)
    return None


def _enclosing(module: str) -> list[str]:
    """`module` and the modules around it, innermost first (the model itself, "", aside)."""
    if not module:
        return []
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _contains(module: str, path: str) -> bool:
    """Whether `path` is `module` or inside it."""
    return path == module or path.startswith(module + ".")
