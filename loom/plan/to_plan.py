"""Between the solvers' placements and a `Plan`'s tensor specs: strategies given by a user pin decisions
(`pins`), and a solution becomes a Plan (`solution_plan`).

A tensor spec (`loom.plan.specs`) names, per tensor dim, the mesh axes that cut it (`["tp", "None"]`), or
gives cuts per dim (`[2, 1]`, read as the one mesh axis of that size); DTensor placements name, per mesh
axis, the dim it cuts. An axis the mesh lacks cuts nothing, as in `loom.parallel.module_plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from loom.plan._dtensor_rules import is_strided
from loom.plan.graph import Graph
from loom.plan.plan import Plan
from loom.plan.problem import requirement
from loom.plan.space import Placements
from loom.plan.specs import MESH_AXES

__all__ = [
    "compute_layout",
    "input_layouts",
    "pins",
    "placements",
    "read_through_views",
    "solution_plan",
    "tensor_spec",
    "view_chain",
]


def placements(spec: Any, ndim: int, mesh: Mapping[str, int], where: str) -> Placements:
    """The DTensor placements of a tensor spec on `mesh` (`where` names it in errors)."""
    if not isinstance(spec, list | tuple) or len(spec) != ndim:
        raise ValueError(f"{where}: {spec!r} must give one entry per dim of the {ndim}-dim tensor")
    chosen: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        if isinstance(entry, int) and not isinstance(entry, bool):
            if entry > 1:
                chosen[_axis_of_size(entry, mesh, chosen, spec, where)] = dim
            continue
        for axis in [entry] if isinstance(entry, str) else list(entry):
            if axis != "None" and axis in mesh:
                chosen[axis] = dim
    return tuple(Shard(chosen[axis]) if axis in chosen else Replicate() for axis in mesh)


def _axis_of_size(cuts: int, mesh: Mapping[str, int], used: dict, spec: Any, where: str) -> str:
    free = [axis for axis, size in mesh.items() if size == cuts and axis not in used]
    if not free:
        raise ValueError(
            f"{where}: {spec!r} cuts a dim in {cuts}, and no unused mesh axis of {dict(mesh)} has that size; "
            f"name the axes instead, e.g. ['tp', 'None']"
        )
    return free[0]


def tensor_spec(ps: Placements, ndim: int, mesh: Mapping[str, int]) -> list | None:
    """The tensor map of placements (None when some axis holds a partial sum, which a spec cannot say). Only
    views make strided cuts, and no spec is written of a view's output: one here is a planner bug."""
    if any(isinstance(p, Partial) for p in ps):
        return None
    if any(is_strided(p) for p in ps):
        raise ValueError(
            f"tensor_spec: a strided cut {ps} has no tensor spec (only a view's output is cut so)"
        )
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for axis, p in zip(mesh, ps, strict=True):
        if isinstance(p, Shard):
            per_dim[p.dim].append(axis)
    return [axes[0] if len(axes) == 1 else axes if axes else "None" for axes in per_dim]


# ---- pins ----


def pins(problem: Any, fixed: Mapping[str, Mapping[str, Any]]) -> dict[str, set[int]]:
    """The options each fixed strategy leaves: `fixed` maps a module path pattern (or an op node name) to a
    Plan strategy entry; `parameter_plan` pins the module's parameters, `in_strategy` what its operators
    require of the tensors that flow into it from outside (in order of first use)."""
    graph, mesh = problem.graph, problem.mesh
    allowed: dict[str, set[int]] = {}
    for key, entry in fixed.items():
        ops = (
            [key]
            if key in problem.decisions and problem.decisions[key].kind == "op"
            else _module_ops(problem, key)
        )
        params = _module_params(problem, key, entry.get("parameter_plan") or {})
        if not ops and not params:
            modules = sorted({n.module for n in graph.ops() if n.module})[:8]
            raise ValueError(
                f"fixed strategy {key!r} matches no module or operator of {graph.model}; module paths "
                f"look like {modules}, operators like {[n.name for n in list(graph.ops())[:4]]}"
            )
        for name, spec in params.items():
            info = graph[name].output(0)
            want = placements(spec, info.ndim, mesh, f"fixed[{key!r}].parameter_plan")
            _restrict(problem, allowed, name, lambda ps, want=want: ps == want, key)
        for i, (op, index) in enumerate(_external_inputs(problem, ops)):
            specs = entry.get("in_strategy") or []
            if i >= len(specs) or specs[i] is None:
                continue
            info = graph.tensor(graph[op].inputs[index])
            want = placements(specs[i], info.ndim, mesh, f"fixed[{key!r}].in_strategy[{i}]")
            _restrict(problem, allowed, op, lambda c, want=want, index=index: c.inputs[index] == want, key)
    return allowed


def _restrict(problem: Any, allowed: dict, name: str, keep, key: str) -> None:
    options = problem.decisions[name].options
    chosen = {i for i, option in enumerate(options) if keep(option)} & allowed.get(
        name, set(range(len(options)))
    )
    if not chosen:
        raise ValueError(
            f"fixed strategy {key!r}: {name} ({problem.graph[name].target}) has no layout that satisfies it on mesh "
            f"{problem.mesh}; check that the cut dims divide by the axis sizes"
        )
    allowed[name] = chosen


def _inside(module: str, path: str) -> bool:
    return fnmatchcase(module, path) or any(
        fnmatchcase(module[:i], path) for i, c in enumerate(module) if c == "."
    )


def _module_ops(problem: Any, pattern: str) -> list[str]:
    graph = problem.graph
    return [n for n, d in problem.decisions.items() if d.kind == "op" and _inside(graph[n].module, pattern)]


def _module_params(problem: Any, pattern: str, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Parameter node -> spec, for the parameters `plan` names in modules matching `pattern`."""
    found = {}
    for path, param in problem.graph.params.items():
        module, _, short = path.rpartition(".")
        node = problem.canon.get(param.node, param.node)
        if short in plan and fnmatchcase(module, pattern) and node in problem.decisions:
            found[node] = plan[short]
    return found


def _external_inputs(problem: Any, ops: list[str]) -> list[tuple[str, int]]:
    """(operator, input index) of the first use of each tensor the operators read from outside their
    module, parameters aside."""
    graph, inside, seen, found = problem.graph, set(ops), set(), []
    for op in ops:
        for index, ref in enumerate(graph[op].inputs):
            source = graph[ref.node]
            if ref.node in inside or source.kind in ("parameter", "buffer") or ref in seen:
                continue
            seen.add(ref)
            found.append((op, index))
    return found


# ---- the Plan ----


def solution_plan(solution: Any) -> Plan:
    """A `Plan` laying out every sharded parameter as chosen (`parameter_layouts`, block index as `*`),
    with `out_strategy` for each module that owns one, so its output leaves it as its consumer needs. The
    solver priced every operator by DTensor's rules, `loom.ops` primitives included: they follow their
    inputs' layouts (`primitives_follow_inputs`) rather than their own strategies."""
    problem = solution.problem
    graph, mesh = problem.graph, problem.mesh
    unknown = [axis for axis in mesh if axis not in MESH_AXES]
    if unknown:
        raise ValueError(
            f"a Plan names mesh axes from {MESH_AXES}; the mesh {mesh} has {unknown}: rename them"
        )
    layouts, computed, owners = {}, {}, {}
    for path, param in graph.params.items():
        decision = problem.decisions.get(param.node)
        if decision is None or decision.kind != "parameter" or graph[param.node].target != path:
            continue  # a later block's (block 0's stands for it), or the second name of a tied one
        ps = solution.option(param.node)
        if any(isinstance(p, Shard) for p in ps):
            layouts[_pattern(graph, path)] = tensor_spec(ps, param.info.ndim, mesh)
            owners[param.module] = param.one_input
        read = compute_layout(solution, param)
        if read is not None and read != ps:
            computed[_pattern(graph, path)] = tensor_spec(read, param.info.ndim, mesh)
    strategies = {}
    for module in sorted(set(owners) - {""}):  # the root's output is the model's: the caller reads it as is
        entry = {}
        # an in_strategy has one entry per positional input: only for a module called with one (q, k, v
        # of an attention, a block's masks would not match it)
        into = _module_input(solution, module) if owners[module] else None
        if into is not None:
            entry["in_strategy"] = [into]
        out = _module_output(solution, module)
        if out is not None:
            entry["out_strategy"] = [out]
        if entry:
            strategies[_pattern(graph, module)] = entry
    sizes = {axis: mesh.get(axis, 1) for axis in ("dp", "tp", "cp")}
    return Plan(
        **sizes,
        strategies=strategies,
        parameter_layouts=layouts,
        compute_layouts=computed,
        input_layouts=input_layouts(solution),
        primitives_follow_inputs=True,
        predicted_step_s=solution.cost_s if solution.cost_s > 0 else None,
        predicted_memory_bytes=int(solution.memory_bytes) if solution.memory_bytes >= 1 else None,
    )


def input_layouts(solution: Any) -> dict[str, list]:
    """Input name -> the spec the model's inputs are read in, for each input whose readers (the first
    non-view operators, through views as `compute_layout` reads them) all require one layout other than how
    it arrives (rows cut over dp): the solver priced moving it on those edges, which DTensor's dispatcher,
    free to pick, would not do (it runs the readers on the rows as they are).

    Only inputs passed as a whole tensor argument by name (`Graph.arguments`: a parameter of `forward`, or
    a keyword) are named: only those become DTensors, and a tensor inside a tuple or `*args` has no name
    to address it by; the readers of the others run on the rows as they arrive."""
    problem, graph = solution.problem, solution.problem.graph
    found = {}
    for node in graph.nodes:
        argument = graph.arguments.get(node.name, "")
        if node.kind != "input" or node.name not in problem.decisions or not argument.isidentifier():
            continue
        wanted = {read_through_views(solution, e) for e in problem.edges if e.ref.node == node.name}
        if len(wanted) != 1:
            continue
        (read,) = wanted
        if (
            read is not None
            and read != solution.option(node.name)
            and not any(isinstance(p, Partial) for p in read)
        ):
            found[argument] = tensor_spec(read, node.output(0).ndim, problem.mesh)
    return found


def compute_layout(solution: Any, param: Any) -> Placements | None:
    """The placements the chosen operators read parameter `param` (a `graph.params` entry) in: what its
    first non-view consumer requires, carried back through the views between them (a linear weight's `t`)
    by the views' own chosen-compatible candidates. None when its readers disagree, lie outside its module,
    or require a pending sum: DTensor's dispatcher then moves it as it sees fit.

    The solver priced moving the parameter from where it is kept to this layout on the edge into its
    consumer; DTensor, left to itself, may instead move the consumer's other input (it prices with its
    own constants), which is neither the plan priced nor, for the gradients it then produces, always
    within what its own rules handle (see docs/planner.md, "8 ranks")."""
    problem, graph = solution.problem, solution.problem.graph
    node = problem.canon.get(param.node, param.node)
    found = set()
    for edge in problem.edges:
        if problem.canon.get(edge.ref.node, edge.ref.node) != node:
            continue
        if not _inside(graph[edge.target].module, param.module):
            return None  # read outside its module's forward, where no hook moves it
        found.add(read_through_views(solution, edge))
    if len(found) != 1:
        return None
    (read,) = found
    if read is None or any(isinstance(p, Partial) for p in read):
        return None
    return read


def view_chain(problem: Any, edge: Any) -> list:
    """`edge` and the edges after it through single-input views read by one operator each (a linear
    weight's `t`), up to the edge into the first operator that is not such a view."""
    graph = problem.graph
    chain = [edge]
    while graph[chain[-1].target].is_view:
        out = [e for e in problem.edges if e.ref.node == chain[-1].target]
        if len(out) != 1:
            break
        chain.append(out[0])
    return chain


def read_through_views(solution: Any, edge: Any) -> Placements | None:
    """What the consumer at the end of `edge`'s chain of single-input views (`view_chain`) requires, as
    placements of the chain's start (None where a view has no candidate giving what the next operator
    requires)."""
    problem = solution.problem
    chain = view_chain(problem, edge)
    need, _ = requirement(
        problem.decisions[chain[-1].target], solution.choice[chain[-1].target], chain[-1].index, problem.mesh
    )
    for link in reversed(chain[:-1]):
        view = problem.decisions[link.target]
        gives = [c.inputs[0] for c in view.options if c.outputs[0] == need]
        if not gives:
            return None
        need = gives[0]
    return need


def _module_input(solution: Any, module: str) -> list | None:
    """The spec the module's one input from outside is read in by the operator chosen for it, so that the
    operator runs as the solver chose (DTensor's dispatcher, free to pick, may move the input otherwise);
    None when the module reads several tensors from outside (an in_strategy addresses positional inputs). A
    pending sum required (a vocabulary-cut embedding's masked ids) arrives whole along that axis: DTensor
    makes it from there on each rank's piece as it is."""
    problem, graph = solution.problem, solution.problem.graph
    inside = [n for n, d in problem.decisions.items() if d.kind == "op" and _inside(graph[n].module, module)]
    external = _external_inputs(problem, inside)
    if len(external) != 1:
        return None
    op, index = external[0]
    required, _ = requirement(problem.decisions[op], solution.choice[op], index, problem.mesh)
    whole = tuple(Replicate() if isinstance(p, Partial) else p for p in required)
    return tensor_spec(whole, graph.tensor(graph[op].inputs[index]).ndim, problem.mesh)


def _module_output(solution: Any, module: str) -> list | None:
    """The spec the module's output is read in by its first consumer outside it (None: a partial sum)."""
    problem, graph = solution.problem, solution.problem.graph
    inside = [n for n, d in problem.decisions.items() if d.kind == "op" and _inside(graph[n].module, module)]
    if not inside:
        return None
    for edge in problem.edges:
        if edge.ref.node == inside[-1] and edge.target not in inside:
            consumer = problem.decisions[edge.target]
            required, _ = requirement(consumer, solution.choice[edge.target], edge.index, problem.mesh)
            return tensor_spec(required, edge.tensor.ndim, problem.mesh)
    return None


def _pattern(graph: Graph, path: str) -> str:
    """`path` with its block index as `*`, so that block 0's choice lays out every block."""
    blocks = graph.blocks
    if blocks is not None and path.startswith(blocks.path + ".0"):
        rest = path[len(blocks.path) + 2 :]
        if rest == "" or rest.startswith("."):
            return f"{blocks.path}.*{rest}"
    return path
