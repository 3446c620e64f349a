"""Tier 1: a chosen plan's gradients in backward (`loom.plan.gradients`), as DTensor moves them: the pending
gradients a tensor's readers leave are summed before they move, carried on through an operator linear in
its gradient whose factors are whole (a product with a whole scale), moved once by the first operator that
cannot take them pending, and a parameter that linear operator reads gets its gradient pending; and the
count of kept targets `F.cross_entropy`'s mean sums over the mesh axes cutting the rows (`step._loss_counts`);
readers' gradients summed into the finest layout; and the pairs of an RMSNorm's product DTensor's dispatcher
never runs (`problem.settled_by_dispatcher`).
Single process; the multi-rank measurement is Llama's case in tests/test_plan_auto_collectives.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from loom.cost.traffic import summary
from loom.plan.capture import capture
from loom.plan.gradients import gradient_flow
from loom.plan.problem import build_problem
from loom.plan.solve import solve
from loom.plan.step import _parameter_view_edges

R, P = Replicate(), Partial()
WHOLE = (R, R)
MESH = {"dp": 2, "tp": 2}
ROWS, WIDTH = 8, 256
HIDDEN_BYTES = ROWS * WIDTH * 4  # the scaled activation, fp32


class Fan(nn.Module):
    """A hidden layer scaled by a vector, read by two column-parallel linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, WIDTH), nn.Linear(WIDTH, 64), nn.Linear(WIDTH, 64)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * self.scale
        return F.mse_loss(self.fc2(h) + self.fc3(h), y)


def _fan_solution():
    """Fan's plan with everything whole but fc2 and fc3, column parallel over tp (weights cut along their
    outputs, the scaled activation read whole): each leaves the activation's gradient pending over tp."""
    graph = capture(Fan(), (torch.randn(ROWS, 16), torch.randn(ROWS, 64)))
    problem = build_problem(graph, MESH)

    def only(name, keep):
        return {i for i, option in enumerate(problem.decisions[name].options) if keep(option)}

    pinned = {name: only(name, lambda c: c.inputs[1] == WHOLE and c.inputs[2] == (R, Shard(1)))
              for name in ("addmm_1", "addmm_2")}  # fmt: skip
    for name in ("relu", "mul"):
        pinned[name] = only(name, lambda c: c.outputs[0] == WHOLE and all(p == WHOLE for p in c.inputs))
    assert all(pinned.values()), pinned
    return solve(problem, pinned=pinned)


def test_pending_gradients_are_summed_carried_through_a_whole_product_and_moved_once():
    solution = _fan_solution()
    problem = solution.problem
    flow = gradient_flow(solution, frozenset(_parameter_view_edges(problem)))
    edges = {(e.ref.node, e.target): e for e in problem.edges}
    # the two readers leave (R, P); summed at `mul`'s output, not moved there
    assert flow.moves[id(edges["mul", "addmm_1"])] is None
    assert flow.moves[id(edges["mul", "addmm_2"])] is None
    # `mul` (by a whole scale) passes the pending sum on along tp; ReLU's backward cannot: moved once
    assert flow.carried == {"mul": frozenset({1})}
    assert flow.moves[id(edges["relu", "mul"])] == ((R, P), WHOLE)

    predicted = summary(solution.predicted_collectives(device="cpu"))
    backward = [c for c in solution.predicted_collectives(device="cpu") if c.phase == "backward"]
    # one all-reduce of the summed gradient where two (one per reader) were predicted before
    assert [(c.kind, c.axis, c.nbytes, c.source) for c in backward] == [
        ("all_reduce", "tp", HIDDEN_BYTES, "relu -> mul")
    ]
    # the scale's gradient arrives pending over tp (the product's output gradient was): a bucket over tp
    assert predicted[("all_reduce", "tp", WIDTH * 4)] == 1, predicted


class Classifier(nn.Module):
    """One linear layer and `F.cross_entropy`'s mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(x), labels)


def _classifier_counts(logits) -> list[tuple]:
    """The predicted count collectives of the classifier's plan with its logits laid out as `logits`."""
    graph = capture(Classifier(), (torch.randn(64, 16), torch.randint(0, 10, (64,))))
    problem = build_problem(graph, MESH)
    options = problem.decisions["addmm"].options
    solution = solve(problem, pinned={"addmm": {i for i, c in enumerate(options) if c.outputs[0] == logits}})
    return [
        (c.kind, c.axis, c.nbytes, c.count)
        for c in solution.predicted_collectives()
        if c.source.startswith("count of kept targets")
    ]


def test_a_mean_cross_entropy_on_cut_rows_sums_its_count_of_targets():
    """`local_cross_entropy` divides by the count of kept targets over the mesh axes cutting the rows (one
    all-reduce of an fp32 count); logits cut along their classes take the vocabulary-parallel path."""
    assert _classifier_counts((Shard(0), R)) == [("all_reduce", "dp", 4, 1)]
    assert _classifier_counts((Shard(0), Shard(0))) == [("all_reduce", "dp+tp", 4, 1)]
    assert _classifier_counts((R, Shard(1))) == []


class Norm(nn.Module):
    """An RMSNorm (Llama's: `weight * (x * rsqrt(mean(x^2) + eps))`) and a squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scaled = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return F.mse_loss(self.norm.weight * scaled, y)


def test_the_dispatcher_never_moves_hidden_states_a_norm_weight_can_meet_as_they_are():
    """Between two operators of one module DTensor's dispatcher makes the move: outside autograd, so the
    product's backward moves the saved hidden states again (priced twice), and where a candidate reads
    them as made (the weight moved instead, by its compute layout) a move with a collective never runs."""
    from loom.plan.problem import moved_again, settled_by_dispatcher

    graph = capture(Norm(), (torch.randn(ROWS, 4, WIDTH), torch.randn(ROWS, 4, WIDTH)))
    problem = build_problem(graph, MESH)
    (edge,) = [e for e in problem.edges if e.target in graph and graph[e.target].target == "aten.mul.Tensor"
               and graph[e.ref.node].target == "aten.mul.Tensor"]  # fmt: skip
    assert moved_again(graph, edge.ref, edge.target) and settled_by_dispatcher(graph, edge.ref, edge.target)
    rows = (Shard(0), R)  # the hidden states as made, rows cut over dp
    made = next(i for i, (layout, _) in enumerate(edge.producer) if layout == rows)
    cost = {required: edge.cost[made][j] for j, ((required, _), _) in enumerate(edge.consumer)}
    assert cost[rows] == 0.0
    assert cost[(Shard(2), R)] == float("inf")  # an all-to-all over dp: never what DTensor runs here
    assert 0.0 <= cost[(Shard(0), Shard(2))] < float("inf")  # a slice, no collective: DTensor may run it
    # the weight's edge is not settled so: a hook (its compute layout) moves it
    (weight,) = [e for e in problem.edges if graph[e.ref.node].kind == "parameter"]
    assert not settled_by_dispatcher(graph, weight.ref, weight.target)
    solution = solve(problem)
    assert solution.cost_s < float("inf")


def test_readers_gradients_are_summed_into_the_finest_layout_each_reaches_by_cutting():
    from loom.plan.gradients import _summed, pending_along

    edges = [object(), object(), object()]
    cut = (Shard(2), Shard(2))
    moves, summed, first = _summed(edges, [(Shard(2), P), cut, (Shard(2), R)])
    assert summed == cut and first is edges[1]
    assert moves == {
        id(edges[0]): ((Shard(2), P), cut),
        id(edges[1]): None,
        id(edges[2]): ((Shard(2), R), cut),
    }
    # a pending and a whole gradient: no layout both reach by cutting (DTensor keeps the sum pending)
    assert _summed(edges[:2], [(P, R), WHOLE])[1] is None
    # a backward reading only the gradient (mean's expand) keeps it pending over a forward cut too
    assert pending_along((Shard(2), R), frozenset({0, 1})) == (Shard(2), P)
    assert pending_along((Shard(2), R), frozenset({0, 1}), over_cuts=True) == (P, P)
