"""Operator-level search timings (`loom.plan.solve`): a 24-layer GPT (GPT-2 medium's shapes, vocabulary padded to 50304, 355M
parameters, built on the meta device) on a 2D mesh, priced on `h100-sxm`.

    .venv/bin/python benchmarks/planner.py            # about a minute on 2 cores

Printed per mesh: seconds to capture (once), to build the strategy space, to price the problem (decisions,
edges, pair variables), and to solve the integer program; the predicted step time, HiGHS's gap, and the
same model with Megatron's layouts propagated (its tensor plan pinned), under the same prices.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from loom.models.recipes import tensor_plan  # noqa: E402
from loom.plan.capture import capture  # noqa: E402
from loom.plan.problem import build_problem  # noqa: E402
from loom.plan.solve import solve  # noqa: E402
from loom.plan.space import strategy_space  # noqa: E402
from loom.plan.to_plan import pins  # noqa: E402

MESHES = ({"dp": 2, "tp": 4}, {"dp": 8, "tp": 8})


def gpt2_medium() -> torch.nn.Module:
    import transformers
    from transformers import GPT2Config

    transformers.logging.set_verbosity_error()
    config = GPT2Config(
        n_layer=24, n_embd=1024, n_head=16, vocab_size=50304, use_cache=False
    )  # padded: cut by 8
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def main() -> None:
    model = gpt2_medium()
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    start = time.perf_counter()
    graph = capture(model, (ids,), {"labels": ids})
    print(f"capture: {time.perf_counter() - start:.1f} s, {len(list(graph.ops()))} op nodes, "
          f"blocks {graph.blocks.traced}/{graph.blocks.count}")  # fmt: skip
    for mesh in MESHES:
        start = time.perf_counter()
        space = strategy_space(graph, mesh)
        spaced = time.perf_counter()
        problem = build_problem(graph, mesh, "h100-sxm", space)
        built = time.perf_counter()
        best = solve(problem)
        solved = time.perf_counter()
        megatron = solve(problem, pinned=pins(problem, tensor_plan(model)))
        pairs = sum(len(e.producer) * len(e.consumer) for e in problem.edges)
        print(
            f"{mesh}: space {spaced - start:.1f} s, pricing {built - spaced:.1f} s "
            f"({len(problem.decisions)} decisions, {len(problem.edges)} edges, {pairs} pairs), "
            f"search {solved - built:.1f} s: {best.cost_s * 1e3:.2f} ms per step (gap {best.gap:.1e}, "
            f"{len(best.plan().parameter_layouts)} cut parameters); Megatron's layouts {megatron.cost_s * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
