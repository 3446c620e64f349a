"""loom's demo: MindSpore's two semi-automatic parallelism examples on CPU worker processes.

For each operator it prints the layouts loom chose, the redistributions it inserted and the collectives they
issued, then checks the result against the same computation on one device.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.dist.comm import collective_counts
from loom.dist.context import unsharded
from loom.models import MatMulChain, ReluNet, SoftCrossEntropy, WithLoss, example_batches, train_sgd
from loom.ops import record

console = Console(width=120)
# CommDebugMode tracks modules with full backward hooks, which warn when no input needs a gradient.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


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
    z.sum().backward()
    return {
        "rows": _operator_rows(recording, mesh),
        "collectives": collective_counts(comm),
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
        "checks": {"final weight": (loom.full(model.net.weight) - reference.net.weight).abs().max().item()},
    }


def show(title: str, result: dict, tolerance: float) -> bool:
    console.rule(title)
    console.print(result["plan"], markup=False)
    table = Table("operator", "input", "arrives as", "laid out as", "redistributed")
    for row in result["rows"]:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)
    console.print(f"collectives in the forward pass: {result['collectives'] or 'none'}")
    ok = True
    if "losses" in result:
        steps = Table("step", "1 device", f"{len(result['losses'])} steps on 2 ranks", "difference")
        for i, (a, b) in enumerate(result["losses"], 1):
            steps.add_row(str(i), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}")
            ok &= abs(a - b) <= tolerance * abs(a)
        console.print(steps)
    for name, error in result["checks"].items():
        ok &= error <= tolerance * 10
        console.print(f"{name}: max |parallel - one device| = {error:.2e}")
    console.print("[bold green]equal to the single-device run[/]" if ok else "[bold red]MISMATCH[/]")
    return ok


def main() -> int:
    ok = show("Z = (X W) V on 4 ranks", loom.launch(matmul_chain, 4)[0], 1e-5)
    ok &= show("relu(matmul(x, weight)) training on 2 ranks", loom.launch(relu_net, 2)[0], 1e-6)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
