"""The solver chooses inside a module what DTensor's dispatcher runs there (`loom.plan.dispatch`): between two
operators of one module no hook moves a tensor, so DTensor picks the strategy of least redistribution cost
for the layouts that arrive, and the solver, constrained round by round, picks the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from loom.plan import _dtensor_rules
from loom.plan.capture import capture
from loom.plan.dispatch import dispatch_mismatches
from loom.plan.opcost import meta_tensor
from loom.plan.problem import OPTIMIZER_COPIES, build_problem
from loom.plan.solve import solve

MESH = {"dp": 2, "tp": 2}


class Norm(nn.Module):
    """An RMSNorm: its weight times the normalized rows, two operators of one module."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Normed(nn.Module):
    """A norm, a linear layer and a squared error."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.norm, self.fc = Norm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc(self.norm(x)) - y) ** 2).mean()


@pytest.fixture(scope="module")
def normed():
    model = Normed()
    x = torch.randn(4, 8, 256)  # few rows: the weights' states outweigh the activations
    problem = build_problem(capture(model, (x, torch.randn(4, 8, 256))), MESH)
    states = OPTIMIZER_COPIES * 4 * sum(p.numel() for p in model.parameters())
    return problem, states / 2


def _weight_product(problem) -> str:
    """The operator that multiplies the norm's weight."""
    graph = problem.graph
    weight = graph.params["norm.weight"].node
    return next(
        n for n in problem.decisions if graph[n].is_op and any(r.node == weight for r in graph[n].inputs)
    )


def test_a_solution_runs_inside_its_modules_as_dtensor_dispatches(normed):
    problem, limit = normed
    solution = solve(problem, memory_limit=limit, method="milp", dispatched=True)
    assert solution.memory_bytes <= limit
    assert dispatch_mismatches(solution) == []


def test_an_operator_chosen_otherwise_than_dtensor_runs_it_is_reported_with_dtensors_choice(normed):
    problem, limit = normed
    solution = solve(problem, memory_limit=limit, method="milp", dispatched=False)
    name = _weight_product(problem)
    node, decision = problem.graph[name], problem.decisions[name]
    infos = [problem.graph.tensor(ref) for ref in node.inputs]
    args, kwargs = node.call_args([meta_tensor(info) for info in infos])
    checked = 0
    for option in range(len(decision.options)):
        chosen = dataclasses.replace(solution, choice={**solution.choice, name: option})
        for mismatch in dispatch_mismatches(chosen):
            given = dict(mismatch.given)
            if mismatch.op != name or name in given:
                continue  # another operator's, or one where a hook moves an input to what it requires
            arriving = tuple(_made(problem, ref, given[ref.node]) for ref in node.inputs)
            runs = _dtensor_rules.dispatch(node.op, args, kwargs, arriving, tuple(MESH.values()))
            assert mismatch.allowed, arriving  # loom has DTensor's choice among its candidates
            for i in mismatch.allowed:  # the options it leaves run as DTensor runs the product there
                assert (decision.options[i].inputs, decision.options[i].outputs) == (
                    runs.inputs,
                    runs.outputs,
                )
            checked += 1
    assert checked, "some option of the product requires a move DTensor would not make"


def _made(problem, ref, options: frozenset[int]):
    """The layout of tensor `ref` that each of its producer's `options` makes."""
    producer = problem.decisions[ref.node]
    (layout,) = {
        producer.options[i].outputs[ref.index] if producer.kind == "op" else producer.options[i]
        for i in options
    }
    return layout
