"""MindSpore's two semi-automatic parallelism examples, run on loom and on one device.

Each function runs inside a worker (`loom.launch(matmul_chain, 4)`) and returns what the demo prints and the
tests check: the layouts of every operator input, the collectives issued, and the differences from the
single-device run.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.dist.comm import collective_counts
from loom.dist.context import unsharded
from loom.models import MatMulChain, ReluNet, SoftCrossEntropy, WithLoss, example_batches, train_sgd
from loom.ops import record


def _describe(layout, mesh) -> str:
    if layout is None:
        return "replicated (plain tensor)"
    return layout.describe(mesh.device_mesh.mesh_dim_names, mesh.canonical_shape)


def _operator_rows(recording, mesh) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for event in recording.events:
        for item in event.inputs:
            moved = "yes" if item.redistributed else "-"
            rows.append(
                (event.op, item.name, _describe(item.before, mesh), _describe(item.after, mesh), moved)
            )
        rows.append((event.op, "output", "", _describe(event.output, mesh), ""))
    return rows


def matmul_chain() -> dict:
    """Z = (X W) V on 4 ranks: matmul1 ((4, 1), (1, 1)), matmul2 ((1, 1), (1, 4))."""
    torch.manual_seed(0)
    reference = MatMulChain()
    model = copy.deepcopy(reference)
    x = torch.randn(16, 8)
    with unsharded():
        expected = reference(x)
        expected.sum().backward()
    mesh = loom.init()
    loom.parallelize(model, mode="semi_auto", example_inputs=(x,), full_batch=True)
    with record() as recording, CommDebugMode() as comm:
        z = model(x)
    with CommDebugMode() as backward_comm:
        z.sum().backward()
    return {
        "rows": _operator_rows(recording, mesh),
        "collectives": collective_counts(comm),
        "backward_collectives": collective_counts(backward_comm),
        "v_local_shape": tuple(model.v.to_local().shape),
        "plan": model.loom.describe(),
        "checks": {
            "Z": (loom.full(z) - expected).abs().max().item(),
            "grad W": (loom.full(model.w.grad) - reference.w.grad).abs().max().item(),
            "grad V": (loom.full(model.v.grad) - reference.v.grad).abs().max().item(),
        },
    }


def relu_net() -> dict:
    """relu(matmul(x, weight)) on 2 ranks, full batch, momentum SGD, 5 epochs of 4 steps."""
    batches = example_batches()
    torch.manual_seed(0)
    reference = WithLoss(ReluNet(), SoftCrossEntropy())
    model = copy.deepcopy(reference)
    with unsharded():
        expected = train_sgd(reference, batches)
    mesh = loom.init()
    loom.parallelize(model, mode="semi_auto", example_inputs=batches[0], full_batch=True)
    with record() as recording, CommDebugMode() as comm:
        model(*batches[0])
    losses = train_sgd(model, batches)
    return {
        "rows": _operator_rows(recording, mesh),
        "collectives": collective_counts(comm),
        "plan": model.loom.describe(),
        "losses": list(zip(expected, losses, strict=True)),
        "weight_local_shape": tuple(model.net.weight.to_local().shape),
        "checks": {"final weight": (loom.full(model.net.weight) - reference.net.weight).abs().max().item()},
    }
