"""Tier 1: a chosen plan's gradients in backward (`loom.plan.gradients`), as DTensor moves them: the pending
gradients a tensor's readers leave are summed before they move, carried on through an operator linear in
its gradient whose factors are whole (a product with a whole scale), moved once by the first operator that
cannot take them pending, and a parameter that linear operator reads gets its gradient pending; and the
count of kept targets `F.cross_entropy`'s mean sums over the mesh axes cutting the rows (`step._loss_counts`).
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
