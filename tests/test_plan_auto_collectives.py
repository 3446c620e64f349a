"""An automatic plan predicts the collectives of its training step: on 4 ranks (dp 2 x tp 2), the collectives
one SGD step issues on each rank, recorded (`CollectiveRecorder`: kind, mesh axes, bytes, calls), equal
`model.loom.predicted_collectives` (the solution's `predicted_collectives`: its priced redistributions of every
block, the parameters' gradients as `GradSync` reduces them, the even-batch check and the agreement), exactly,
for an MLP, a small CNN, loom's GPT and Hugging Face GPT-2, Llama and Mixtral without a memory limit (their
labels, shifted and flattened on the way to the loss, priced as DTensor moves strided cuts), and for the
MLP under half its states (weights cut over dp and tp). Hugging Face Llama and loom's GPT under half their
states are not exact yet (strict xfails: docs/planner.md, "Not yet exact"): Llama's RMSNorm products are
read as DTensor's dispatcher runs them and its backward's pending and cut gradients followed as DTensor
carries them, but one gradient move across a block boundary is still predicted where none runs."""

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


class Deep(nn.Module):
    """Three linear layers, many rows: the planner keeps the weights whole and cuts the rows (data
    parallel), each weight read through `aten.t`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 512), nn.Linear(512, 384), nn.Linear(384, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.c(torch.relu(self.b(torch.relu(self.a(x))))) - y).pow(2).mean()


DEEP_ROWS = 32768


class Twice(nn.Module):
    """An input read by two linear layers: the plan gathers it once for both (`input_layouts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.fc3(torch.relu(self.fc1(x)) * self.fc2(x)) - y).pow(2).mean()


def _model_case(family: str):
    """The model, its batches (global rows) and how one becomes (args, kwargs) of its forward."""
    if family == "deep":
        generator = torch.Generator().manual_seed(1)
        torch.manual_seed(0)
        data = [tuple(torch.randn(DEEP_ROWS, 256, generator=generator) for _ in range(2)) for _ in range(2)]
        return Deep(), data, lambda batch: (batch, {})
    if family not in ("mlp", "twice"):
        return _case(family)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    data = [
        (torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator))
        for _ in range(STEPS)
    ]
    return (MLP() if family == "mlp" else Twice()), data, lambda batch: (batch, {})


def _half_the_states(model: nn.Module) -> float:
    """Half the bytes of the unsharded states (parameters, gradients, AdamW's moments in fp32)."""
    return OPTIMIZER_COPIES * 4 * sum(p.numel() for p in model.parameters() if p.requires_grad) / 2


def predicted_and_recorded_case(family: str, limited: bool, bucket_mb: float = 25.0) -> tuple:
    """The plan's predicted collectives of one step and those the second SGD step issued on this rank, as
    Counters of (kind, axis, bytes) -> calls, and the plan."""
    reference, data, as_call = _model_case(family)
    mesh = loom.init(MESH)
    rows = lambda batch: torch.utils._pytree.tree_map(lambda t: t.chunk(2)[mesh.dp_rank()], batch)  # noqa: E731
    args, kwargs = as_call(rows(data[0]))
    model = copy.deepcopy(reference)
    limit = _half_the_states(reference) if limited else None
    loom.parallelize(model, mode="auto", example_inputs=args, example_kwargs=kwargs, memory_limit=limit,
                     bucket_mb=bucket_mb)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorded = []
    for batch in data[:2]:  # the second step: the steady one (gradient buckets are learnt in the first)
        with CollectiveRecorder() as recorder:
            loss = _loss(model, *as_call(rows(batch)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.full_tensor()  # the loss read whole, as a Trainer step reads it for its metrics
        recorded.append(recorder.summary(mesh_axes(tuple(MESH), tuple(MESH.values()), dist.get_rank())))
    return summary(model.loom.predicted_collectives), recorded[-1], model.loom.plan.to_json()


def _check_predicted(results) -> None:
    """Every rank applied the same plan and issued exactly the collectives it predicted."""
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


# strict: the day a change makes them exact, the mark must go (and docs/planner.md's list with it)
NOT_EXACT = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # the prediction differs; a crash or a failed plan is still a failure
    reason="under a memory limit DTensor's dispatcher picks strategies inside modules otherwise than the solver "
    "priced (the tied token table's lookup, the residual adds, the norms, the loss's operators) and sums "
    "gradients its own way (docs/planner.md, 'Not yet exact')",
)


# strict: the plan the kept-copy memory model picks for Llama (weights gathered by compute layouts) predicts
# one backward all-gather of the residual stream's gradient more than runs: DTensor sums two readers'
# gradients across a block boundary first (docs/planner.md, 'Not yet exact')
LLAMA_NOT_EXACT = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="one backward all-gather of the residual stream's gradient (dp+tp, 16 KiB) predicted where DTensor "
    "sums two readers' gradients across a block boundary first (docs/planner.md, 'Not yet exact')",
)


# 4 ranks, a capture and a search on rank 0 each; `make test` keeps the MLP cut under a memory limit
@pytest.mark.parametrize(
    ("family", "limited"),
    [
        ("mlp", True),
        pytest.param("mlp", False, marks=pytest.mark.slow),
        pytest.param("cnn", False, marks=pytest.mark.slow),
        pytest.param("gpt", False, marks=pytest.mark.slow),
        pytest.param("gpt2", False, marks=pytest.mark.slow),
        pytest.param("llama", False, marks=pytest.mark.slow),
        pytest.param("mixtral", False, marks=pytest.mark.slow),
        pytest.param("twice", False, marks=pytest.mark.slow),
        pytest.param("llama", True, marks=[pytest.mark.slow, LLAMA_NOT_EXACT]),
        pytest.param("gpt", True, marks=[pytest.mark.slow, NOT_EXACT]),
    ],
)
def test_an_automatic_plan_predicts_the_collectives_of_its_step(dist_run, family, limited):
    results = dist_run(4, predicted_and_recorded_case, family, limited)
    _check_predicted(results)
    if family == "twice":  # the case of an input moved once by its hook for its two readers
        assert "x" in Plan.from_json(results[0][2]).input_layouts
    if limited:  # a case where the plan cuts weights over both axes, not only the batch
        layouts = Plan.from_json(results[0][2]).parameter_layouts
        assert any("tp" in str(spec) and "dp" in str(spec) for spec in layouts.values()), layouts


@pytest.mark.slow  # 4 ranks, 32768 rows through three layers
def test_a_data_parallel_plan_predicts_its_gradient_buckets(dist_run):
    """Weights kept whole and read through `aten.t`: their gradients wait, pending over the whole mesh,
    for the buckets, which a small `bucket_mb` cuts where the order backward reaches them puts the cut."""
    results = dist_run(4, predicted_and_recorded_case, "deep", False, 0.6)
    _check_predicted(results)
    predicted, _, plan = results[0]
    assert not Plan.from_json(plan).parameter_layouts, "the plan keeps every weight whole"
    buckets = sorted(n for (kind, axis, n), calls in predicted.items() if kind == "all_reduce" and n > 4096
                     for _ in range(calls))  # fmt: skip
    assert len(buckets) == 2, predicted  # 1708544 bytes of gradients; a bucket closes once it holds 0.6 MB


def test_an_input_layout_for_an_argument_forward_lacks_names_it():
    from loom.parallel.auto import read_inputs_in

    with pytest.raises(
        ValueError, match=r"plan.input_layouts names 'z', which is not an argument of MLP.forward"
    ):
        read_inputs_in(MLP(), {"z": ["dp", "None"]}, mesh=None)


def test_a_failed_prediction_leaves_the_plan_and_warns_naming_the_cause():
    from types import SimpleNamespace

    from loom.parallel.auto import _prediction

    def fails(**_):
        raise KeyError("aten.t")

    solution = SimpleNamespace(predicted_collectives=fails)
    mesh = SimpleNamespace(device_mesh=SimpleNamespace(device_type="cpu"))
    with pytest.warns(UserWarning, match=r"predicting its step's collectives failed \(KeyError: 'aten.t'\)"):
        assert _prediction(solution, mesh, 25.0, False) is None
