"""An automatic plan predicts the collectives of its training step: on 4 ranks (dp 2 x tp 2), the collectives
one SGD step issues on each rank, recorded (`CollectiveRecorder`: kind, mesh axes, bytes, calls), equal
`model.loom.predicted_collectives` (the solution's `predicted_collectives`: its priced redistributions of every
block, the parameters' gradients as `GradSync` reduces them, the even-batch check and the agreement), exactly,
for an MLP, a small CNN and loom's GPT without a memory limit, and for the MLP under half its states (weights
cut over dp and tp)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_plan_auto import MESH, STEPS, _case, _loss
from torch import nn

import loom
from loom.cost.traffic import summary
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.plan import Plan
from loom.plan.problem import OPTIMIZER_COPIES


class MLP(nn.Module):
    """Two linear layers with a ReLU between, and a squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def _model_case(family: str):
    """The model, its batches (global rows) and how one becomes (args, kwargs) of its forward."""
    if family != "mlp":
        return _case(family)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    data = [
        (torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator))
        for _ in range(STEPS)
    ]
    return MLP(), data, lambda batch: (batch, {})


def _half_the_states(model: nn.Module) -> float:
    """Half the bytes of the unsharded states (parameters, gradients, AdamW's moments in fp32)."""
    return OPTIMIZER_COPIES * 4 * sum(p.numel() for p in model.parameters() if p.requires_grad) / 2


def predicted_and_recorded_case(family: str, limited: bool) -> tuple:
    """The plan's predicted collectives of one step and those the second SGD step issued on this rank, as
    Counters of (kind, axis, bytes) -> calls."""
    reference, data, as_call = _model_case(family)
    mesh = loom.init(MESH)
    rows = lambda batch: torch.utils._pytree.tree_map(lambda t: t.chunk(2)[mesh.dp_rank()], batch)  # noqa: E731
    args, kwargs = as_call(rows(data[0]))
    model = copy.deepcopy(reference)
    limit = _half_the_states(reference) if limited else None
    loom.parallelize(model, mode="auto", example_inputs=args, example_kwargs=kwargs, memory_limit=limit)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorded = []
    for batch in data[:2]:  # the second step: the steady one (gradient buckets are learnt in the first)
        with CollectiveRecorder() as recorder:
            loss = _loss(model, *as_call(rows(batch)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        recorded.append(recorder.summary(mesh_axes(tuple(MESH), tuple(MESH.values()), dist.get_rank())))
    return summary(model.loom.predicted_collectives), recorded[-1], model.loom.plan.to_json()


# 4 ranks, a capture and a search on rank 0 each; `make test` keeps the MLP cut under a memory limit
@pytest.mark.parametrize(
    ("family", "limited"),
    [
        ("mlp", True),
        pytest.param("mlp", False, marks=pytest.mark.slow),
        pytest.param("cnn", False, marks=pytest.mark.slow),
        pytest.param("gpt", False, marks=pytest.mark.slow),
    ],
)
def test_an_automatic_plan_predicts_the_collectives_of_its_step(dist_run, family, limited):
    results = dist_run(4, predicted_and_recorded_case, family, limited)
    assert len({plan for *_, plan in results}) == 1, "every rank applies the same plan"
    for rank, (predicted, recorded, _) in enumerate(results):
        assert recorded, f"rank {rank} recorded no collective"
        assert predicted == recorded, (
            rank,
            "predicted only:",
            predicted - recorded,
            "ran only:",
            recorded - predicted,
        )
    if limited:  # a case where the plan cuts weights over both axes, not only the batch
        layouts = Plan.from_json(results[0][2]).parameter_layouts
        assert any("tp" in str(spec) and "dp" in str(spec) for spec in layouts.values()), layouts


def test_an_input_layout_for_an_argument_forward_lacks_names_it():
    from loom.parallel.auto import read_inputs_in

    with pytest.raises(
        ValueError, match=r"plan.input_layouts names 'z', which is not an argument of MLP.forward"
    ):
        read_inputs_in(MLP(), {"z": ["dp", "None"]}, mesh=None)
