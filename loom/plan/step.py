"""The collectives one training step of an automatic plan issues on a rank, predicted from its `Solution`.

What runs, per step (one forward, one backward, optimizer level 0), in `loom.cost.traffic`'s vocabulary
(`StepCollective`: kind, mesh axes joined by "+", bytes as `loom.dist.comm` counts them, count):

- forward: the even-batch check (one all-reduce over the whole mesh, `CHECK_BYTES_PER_INPUT` per tensor
  `forward` takes as a whole argument; none with `full_batch`);
  every edge's redistribution the solver priced, each edge as often as the model runs it (block 0 stands
  for every block: `EdgeCost.weight`), consecutive axes of one change merged over their flattened group
  (`loom.plan.redistribute`), a tensor a hook moves for all its readers (`input_layouts`,
  `compute_layouts`, a module's `out_strategy` for the readers outside it that read its layout) once; a graph output with no dims (the loss) read whole, as a `Trainer` step reads
  it for its metrics (`global_mean`: `full_tensor`), other graph outputs as they are made; for
  `F.cross_entropy`'s mean, run as `loom.parallel.lift.local_cross_entropy`, the count of kept targets
  summed over the mesh axes that cut the logits' rows (`_loss_counts`; not priced by the solver);
- backward: a move DTensor's dispatcher made between two operators of one module once more, where the
  consumer saved that input (`problem.moved_again`: autograd kept it as it arrived); each edge's gradient
  moved as DTensor moves it (`loom.plan.gradients`: the gradients of a tensor's readers summed before they
  move, a pending sum carried on through operators linear in it with whole factors and moved by the first
  operator that cannot take it pending, a gradient cut finer than a pointwise producer's output passed on
  cut; the solver prices each edge's move on that edge), but for the parameters' own gradients, which are what `GradSync` makes of
  them: a parameter read as it is kept gets its gradient in the layout its consumer's backward leaves
  (`gradient_layouts`; pending too along the axes that consumer carries a pending gradient on); DTensor brings the axes where the parameter is cut to
  its cut (`loom.parallel.routes`), then the pending sums over axes where it is whole are summed in the
  buckets; a parameter read in another layout (`compute_layouts`) gets its gradient back to its kept
  layout inside autograd, where the move is priced; a parameter read through views (a linear weight's
  `t`) is read as the first operator past them requires, the views carrying its gradient through as that
  operator's backward leaves it;
- gradient sync: one all-reduce per bucket (`loom.cost.buckets.assign_buckets`, the gradients in the
  order backward reaches them: reverse of their parameters' first use, each block's once per block, the
  last block first; keyed by group and copies as `dtensor_route` keys them), then the agreement over the whole mesh
  (`AGREE_BYTES_PER_PARAMETER` per trainable parameter).

On CPU (`device="cpu"`), DTensor runs an all-to-all as an all-gather of each rank's piece (gloo has no
all-to-all), which is what is predicted there. Not predicted: optimizer levels above 0, several
micro-batches, a parameter read by operators that leave its gradient in different layouts, a parameter
read again after later ones (its gradient arrives, and is bucketed, earlier than predicted), and what
DTensor, free inside a module (no hook of loom's moves a tensor there), does otherwise than priced: an
operator's strategy given inputs that do not fit, where the solver could not tell it from one edge
(`problem.settled_by_dispatcher` settles an operator whose other inputs are parameters, as an RMSNorm's
`weight * hidden_states`; a solution of `solve(..., dispatched=True)` chooses in forward what DTensor
runs); and the per-row sums of loom's vocabulary-parallel cross entropy (docs/planner.md, "Not yet
exact").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from torch.distributed.tensor import Partial, Replicate

from loom.cost.buckets import assign_buckets, bucket_bytes
from loom.cost.traffic import AGREE_BYTES_PER_PARAMETER, CHECK_BYTES_PER_INPUT, StepCollective
from loom.layout.placements import cuts_classes, pending_over_rows, row_placements
from loom.plan.gradients import GradientFlow, gradient_flow, pending_along
from loom.plan.problem import carries_gradient, local_bytes, moved_again, requirement
from loom.plan.redistribute import Step, gradient_layouts, redistribution
from loom.plan.space import Placements
from loom.plan.to_plan import compute_layout, input_layouts, read_through_views, view_chain

__all__ = ["predicted_collectives"]

DEVICES = ("cuda", "cpu")


def predicted_collectives(
    solution: Any, *, device: str = "cuda", bucket_mb: float = 25.0, full_batch: bool = False
) -> list[StepCollective]:
    """The collectives one training step under `solution`'s plan issues on one rank (module docstring):
    `device` the ranks compute on ("cpu": all-to-alls run as all-gathers), `bucket_mb` and `full_batch`
    as given to `loom.parallelize` (with `full_batch` every rank brings the whole batch: no even-batch
    check)."""
    if device not in DEVICES:
        raise ValueError(f"predicted_collectives: device={device!r}; use one of {DEVICES}")
    problem = solution.problem
    world = "+".join(axis for axis, size in problem.mesh.items() if size > 1)
    # the check counts the tensors `forward` gets as whole arguments, those `parallelize` makes DTensors of
    inputs = 0 if full_batch else len(problem.graph.arguments)
    out = [StepCollective(kind="all_reduce", axis=world, nbytes=CHECK_BYTES_PER_INPUT * inputs, count=1,
                          phase="forward", source="even-batch check of the inputs' rows")] if inputs else []  # fmt: skip
    synced = []  # (parameter decision, placements its gradient is bucketed in)
    chained, again = _parameter_view_edges(problem), _moved_before(solution)
    flow = gradient_flow(solution, frozenset(chained))
    for edge in problem.edges:
        out += _edge_collectives(
            solution, edge, forward=id(edge) not in again, backward=id(edge) not in chained, flow=flow
        )
    out += _loss_counts(solution)
    for name in _parameters_in_backward_order(problem):
        gradient = _parameter_gradient(solution, name, flow)
        if gradient is not None:
            steps, bucketed = gradient
            out += _collectives(steps, problem.decisions[name].weight, "backward", f"gradient of {name}")
            if bucketed is not None:
                synced.append((name, bucketed))
    out += _buckets(solution, synced, bucket_mb)
    params = sum(
        d.weight for d in problem.decisions.values() if d.kind == "parameter" and _trainable(problem, d)
    )
    if params:
        out.append(StepCollective(kind="all_reduce", axis=world, nbytes=AGREE_BYTES_PER_PARAMETER * round(params),
                                  count=1, phase="grad_sync", source="agreement on which parameters got gradients"))  # fmt: skip
    return [_on_device(c, problem.mesh, device) for c in out if c.count > 0 and c.axis]


def _collectives(steps: Iterable[Step], weight: float, phase: str, source: str) -> list[StepCollective]:
    return [
        StepCollective(
            kind=s.kind, axis=s.axis, nbytes=round(s.nbytes), count=round(weight), phase=phase, source=source
        )  # fmt: skip
        for s in steps
    ]


def _edge_collectives(
    solution: Any, edge: Any, *, forward: bool = True, backward: bool = True, flow: GradientFlow | None = None
) -> list[StepCollective]:
    """An edge's forward redistribution (unless `forward` is False: a hook moved its tensor for an earlier
    reader, `_moved_before`) and, unless it is a parameter's own gradient (`_parameter_gradient`:
    `backward` False for the edges through the views the parameter is read by), its gradient's way back:
    as `flow` moves it (`loom.plan.gradients`: summed over the tensor's readers, carried pending through
    operators linear in it), else from the layout the consumer leaves to the producer's."""
    problem = solution.problem
    producer, consumer = problem.decisions[edge.ref.node], problem.decisions[edge.target]
    picked = producer.options[solution.choice[edge.ref.node]]
    made = picked.outputs[edge.ref.index] if producer.kind == "op" else picked
    required, split = requirement(consumer, solution.choice[edge.target], edge.index, problem.mesh)
    if consumer.kind == "output":
        if edge.tensor.ndim:  # logits and the like: read, if at all, as they are made
            return []
        required = tuple(Replicate() for _ in problem.mesh)  # the loss read whole, as `Trainer` reads it
    where = f"{edge.ref!r} -> {edge.target}"
    nbytes, mesh, cluster = edge.tensor.nbytes, problem.mesh, problem.cluster
    out = []
    if forward:
        moved = redistribution(nbytes, made, required, mesh, cluster)
        out += _collectives(moved, edge.weight, "forward", where)
        if moved_again(problem.graph, edge.ref, edge.target):  # DTensor's move, outside autograd: again
            out += _collectives(moved, edge.weight, "backward", f"{where} (the saved input moved again)")
    if flow is not None and backward and id(edge) in flow.moves:
        move = flow.moves[id(edge)]
        if move is not None:
            out += _collectives(redistribution(nbytes, *move, mesh, cluster), edge.weight, "backward", where)
    elif backward and producer.kind != "parameter" and carries_gradient(problem.graph, edge.ref, edge.target):
        left, wanted = gradient_layouts(made, required, split)
        out += _collectives(
            redistribution(nbytes, left, wanted, mesh, cluster), edge.weight, "backward", where
        )
    return out


MEAN = 1  # `nll_loss_forward`'s reduction argument for a mean (torch's `Reduction.MEAN`)
COUNT_BYTES = 4  # `local_cross_entropy` counts the kept targets in fp32


def _loss_counts(solution: Any) -> list[StepCollective]:
    """The count of kept targets that `F.cross_entropy` with a mean all-reduces, run as loom's
    `local_cross_entropy` (`loom.parallel.lift`): captured as `_log_softmax` and `nll_loss_forward`, it
    divides each rank's sum of losses by the count over the mesh axes that cut the logits' rows as they
    arrive (`full_tensor` of a pending count, `COUNT_BYTES`). Logits whose classes are cut take the
    vocabulary-parallel path instead, whose per-row sums are not predicted."""
    problem = solution.problem
    graph, mesh = problem.graph, problem.mesh
    out = []
    for edge in problem.edges:
        node = graph[edge.target] if edge.target in graph else None
        if node is None or node.target != "aten._log_softmax.default" or edge.index != 0:
            continue
        readers = [graph[user] for user in graph.users(node.name)]
        mean = [r for r in readers if r.target == "aten.nll_loss_forward.default" and r.args[3] == MEAN]
        if not mean or edge.tensor.ndim != 2:
            continue
        producer = problem.decisions[edge.ref.node]
        picked = producer.options[solution.choice[edge.ref.node]]
        logits = picked.outputs[edge.ref.index] if producer.kind == "op" else picked
        if cuts_classes(logits, edge.tensor.shape[1], list(mesh.values())):
            continue
        pending = tuple(pending_over_rows(row_placements(logits)))
        steps = redistribution(COUNT_BYTES, pending, tuple(Replicate() for _ in mesh), mesh, problem.cluster)
        out += _collectives(
            steps, edge.weight * len(mean), "forward", f"count of kept targets of {mean[0].name}"
        )
    return out


def _parameter_view_edges(problem: Any) -> set[int]:
    """The ids of the edges after a parameter through the views it is read by (`view_chain`: a linear weight's `t`):
    DTensor carries the gradient back through them as its consumer left it, which `_parameter_gradient`
    predicts whole."""
    return {
        id(link)
        for edge in problem.edges
        if problem.decisions[edge.ref.node].kind == "parameter"
        for link in view_chain(problem, edge)[1:]
    }


def _moved_before(solution: Any) -> set[int]:
    """The ids of the edges, up to the first operator past any views, from the second and later readers of
    a tensor that a hook moves once per forward for all its readers: an input of `input_layouts`, a
    parameter of `compute_layouts` (every reader requires the same layout there). DTensor moves any other
    tensor for each operator that reads it."""
    problem, graph = solution.problem, solution.problem.graph
    named = input_layouts(solution)
    sources = {node for node, argument in graph.arguments.items() if argument in named}
    for param in graph.params.values():
        node = problem.canon.get(param.node, param.node)
        if node in problem.decisions and problem.decisions[node].kind == "parameter":
            read = compute_layout(solution, param)
            if read is not None and read != solution.option(node):
                sources.add(node)
    again = set()
    for source in sources:
        readers = [edge for edge in problem.edges if edge.ref.node == source]
        again |= {id(link) for edge in readers[1:] for link in view_chain(problem, edge)}
    return again | _moved_by_out_strategy(solution)


def _moved_by_out_strategy(solution: Any) -> set[int]:
    """The ids of the edges from a module's output (its last operator) to the second and later readers
    outside it that read it in the layout its `out_strategy` moves it to: the hook moves it once, for
    every reader (the token embedding's output, read by the first norm and the first residual `Add`)."""
    problem, graph = solution.problem, solution.problem.graph
    blocks = graph.blocks
    again = set()
    for pattern, entry in solution.plan().strategies.items():
        if not entry.get("out_strategy"):
            continue
        module = pattern.replace(f"{blocks.path}.*", f"{blocks.path}.0") if blocks is not None else pattern
        inside = [
            n for n, d in problem.decisions.items() if d.kind == "op" and _within(graph[n].module, module)
        ]
        if not inside:
            continue
        readers = [
            edge for edge in problem.edges
            if edge.ref.node == inside[-1] and edge.target in graph and not _within(graph[edge.target].module, module)
        ]  # fmt: skip
        wanted = [requirement(problem.decisions[e.target], solution.choice[e.target], e.index, problem.mesh)[0]
                  for e in readers]  # fmt: skip
        again |= {id(edge) for edge, read in zip(readers[1:], wanted[1:], strict=True) if read == wanted[0]}
    return again


def _within(path: str, module: str) -> bool:
    """Whether module `path` is `module` or inside it."""
    return path == module or path.startswith(module + ".")


def _parameter_gradient(
    solution: Any, name: str, flow: GradientFlow | None = None
) -> tuple[list[Step], Placements | None] | None:
    """The gradient of trainable parameter `name` (a decision): the collectives DTensor runs on it before
    the sync, and the placements it is bucketed in (None: nothing pending over a whole axis); None when no
    gradient reaches it.

    Its first reader stands for all: the layout required by the first operator past the views it is read
    through (carried back through them, `read_through_views`: a `t` swaps the cut dims) and the axes that
    operator cuts its work along decide what its backward leaves, pending too along the axes where that
    operator carries a pending gradient on (`flow`). A parameter read by several operators whose backwards
    leave different layouts is not predicted exactly."""
    problem = solution.problem
    if not _trainable(problem, problem.decisions[name]):
        return None
    kept = solution.option(name)
    edges = [
        e for e in problem.edges if e.ref.node == name and carries_gradient(problem.graph, e.ref, e.target)
    ]
    if not edges:
        return None
    last = view_chain(problem, edges[0])[-1]
    through = read_through_views(solution, edges[0]) if last is not edges[0] else None
    # the operator whose work decides the gradient: past the views when they can be read through
    reader = last if through is not None else edges[0]
    required, split = requirement(problem.decisions[reader.target], solution.choice[reader.target],
                                  reader.index, problem.mesh)  # fmt: skip
    if through is not None:  # read through views: what the consumer requires, as the parameter's placements
        required = through
    left, wanted = gradient_layouts(kept, required, split)
    if flow is not None:
        left = pending_along(left, flow.carried.get(reader.target, frozenset()))
    mesh, cluster, nbytes = problem.mesh, problem.cluster, edges[0].tensor.nbytes
    if required != kept:
        # read in another layout (a compute layout, or DTensor's move): autograd brings the gradient back
        return redistribution(nbytes, left, wanted, mesh, cluster), None
    # `dtensor_route`: pending sums over axes where the parameter is whole wait for the buckets; every
    # other axis DTensor brings to the parameter's placement now
    pending = tuple(
        g if isinstance(g, Partial) and isinstance(p, Replicate) else p
        for g, p in zip(left, kept, strict=True)
    )
    steps = redistribution(nbytes, left, pending, mesh, cluster)
    dims = [i for i, p in enumerate(pending) if isinstance(p, Partial)]
    if not dims:
        return steps, None
    if dims != list(range(dims[0], dims[0] + len(dims))):  # no one group: `fix_placements` after the sync
        return steps + redistribution(nbytes, pending, kept, mesh, cluster), None
    return steps, pending


def _buckets(solution: Any, synced: list[tuple[str, Placements]], bucket_mb: float) -> list[StepCollective]:
    """One all-reduce per bucket of the pending gradients, cut as `GradSync` cuts them: in the order the
    gradients arrive in backward (`synced` is in `_parameters_in_backward_order`, each block's parameters
    once per block), one bucket per group and copies until it holds `bucket_mb`."""
    problem = solution.problem
    names, sizes = list(problem.mesh), list(problem.mesh.values())
    keyed = {}
    for name, pending in synced:
        info = problem.graph[name].output(0)
        axes = "+".join(names[i] for i, p in enumerate(pending) if isinstance(p, Partial))
        copies = math.prod(size for p, size in zip(pending, sizes, strict=True) if isinstance(p, Replicate))
        keyed[name] = ((axes, copies, info.dtype), round(local_bytes(info, pending, problem.mesh)))
    items = [keyed[name] for name in _in_backward_arrival(problem, [name for name, _ in synced])]
    out = []
    for indices in assign_buckets(items, bucket_bytes(bucket_mb)):
        (axes, _, _), _ = items[indices[0]]
        out.append(StepCollective(kind="all_reduce", axis=axes, nbytes=sum(items[i][1] for i in indices), count=1,
                                  phase="grad_sync", source="gradient bucket"))  # fmt: skip
    return out


def _parameters_in_backward_order(problem: Any) -> list[str]:
    """The parameter decisions, each once, in the reverse order of their first reader in the graph: the
    order backward reaches them (a parameter read again later arrives earlier in truth; not predicted)."""
    position = {node.name: i for i, node in enumerate(problem.graph.nodes)}
    first = {}
    for edge in problem.edges:
        if problem.decisions[edge.ref.node].kind == "parameter":
            first[edge.ref.node] = min(first.get(edge.ref.node, len(position)), position[edge.target])
    return sorted(first, key=lambda name: -first[name])


def _in_backward_arrival(problem: Any, names: list[str]) -> list[str]:
    """`names` (in `_parameters_in_backward_order`) repeated as their gradients arrive over the whole model:
    block 0's parameters (`Decision.weight` the block count) stand for every block, the last block's
    arriving first; the parameters after the blocks come before them, those before the blocks after."""
    weight = {name: round(problem.decisions[name].weight) for name in names}
    blocks = max(weight.values(), default=1)
    inside = [i for i, name in enumerate(names) if weight[name] > 1]
    if not inside:
        return [name for name in names for _ in range(weight[name])]
    start, end = inside[0], inside[-1] + 1
    block = names[start:end]
    repeated = [name for copy in range(blocks) for name in block if weight[name] > copy]
    return names[:start] + repeated + names[end:]


def _trainable(problem: Any, decision: Any) -> bool:
    param = problem.graph.params.get(problem.graph[decision.name].target)
    return param is not None and param.trainable


def _on_device(c: StepCollective, mesh: dict[str, int], device: str) -> StepCollective:
    """What DTensor runs for `c` on `device`: on CPU an all-to-all is an all-gather of each rank's piece."""
    if device != "cpu" or c.kind != "all_to_all":
        return c
    size = math.prod(mesh[axis] for axis in c.axis.split("+"))
    return dataclasses.replace(c, kind="all_gather", nbytes=c.nbytes * size)
