"""loom's demo: MindSpore's two semi-automatic parallelism examples on CPU worker processes.

For each operator it prints the layouts loom chose, the redistributions it inserted and the collectives they
issued, then checks the result against the same computation on one device.
"""

from __future__ import annotations

import sys
import warnings

from mindspore_docs import matmul_chain, relu_net
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import loom

console = Console(width=120)
# CommDebugMode tracks modules with full backward hooks, which warn when no input needs a gradient.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


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
