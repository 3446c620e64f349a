"""The planner's timings and quality.

Outer search (`loom.plan.outer.search_plans`): the coarse search for GPT-3 175B on 1024 H100s (goal under
60 s, stretch under 10 s), and the plan-quality table: for every row of Narayanan et al. 2021 Table 1 and
Korthikanti et al. 2022 Table 5, the search's best against the published configuration, both priced by the
simulator on the same hardware profile and global batch. Two searches per row: "free" (every recompute
policy, optimizer level and sequence parallelism) and "as published" (the row's recompute policy and
sequence parallelism, optimizer level 0: the techniques the published run had). Columns: the best's step
and plan, the published plan's step, its rank (1 + plans predicted faster) and its gap to the best.

    .venv/bin/python benchmarks/planner.py --outer    # the outer search only (about a minute on 2 cores)

Operator-level search timings (`loom.plan.solve`): a 24-layer GPT (GPT-2 medium's shapes, vocabulary padded to 50304, 355M
parameters, built on the meta device) on a 2D mesh, priced on `h100-sxm`.

    .venv/bin/python benchmarks/planner.py            # both parts: a few minutes on 2 cores

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
QUALITY_SOURCES = ("korthikanti2022", "narayanan2021")


def coarse_search_time() -> None:
    """GPT-3 175B on 1024 H100s, global batch 1536 x 2048 tokens: the whole outer search."""
    from loom.cost.hardware import get_cluster
    from loom.plan.outer import search_plans
    from loom.sim.presets import get_model

    found = search_plans(get_model("gpt3-175b"), get_cluster("h100-sxm"), 1024, 1536, 2048)
    best = found.best.plan
    print(
        f"outer search, gpt3-175b on 1024 x h100-sxm: {found.seconds:.1f} s ({found.considered} plans priced, "
        f"{found.simulated} simulated); best dp {best.dp} tp {best.tp} pp {best.pp} x{best.interleave}, "
        f"micro-batch {best.micro_batch}, level {best.optimizer_level}, {best.recompute}: "
        f"{found.best.result.iteration_s:.3f} s, MFU {found.best.result.mfu:.1%}"
    )


def _quality_row(case, free: bool) -> str:
    """One row of the quality table: search like the case, compare with its published plan."""
    from loom.plan.outer import search_plans
    from loom.sim.simulator import simulate

    p = case.plan
    limits = {} if free else {"recompute": (p.recompute,), "optimizer_levels": (0,),
                              "sequence_parallel": (p.sequence_parallel,)}  # fmt: skip
    found = search_plans(case.model, case.cluster, case.cluster.gpus, p.global_batch, p.seq, dtype=p.dtype,
                         overlap_grad_sync=p.overlap_grad_sync, **limits)  # fmt: skip
    published, best = simulate(case.model, p, case.cluster), found.best
    rank = 1 + sum(c.result.iteration_s < published.iteration_s * (1 - 1e-9) for c in found.candidates)
    gap = published.iteration_s / best.result.iteration_s - 1
    b = best.plan
    beats = best.result.tokens_per_s >= published.tokens_per_s * (1 - 1e-9)
    ok = beats and rank <= 10 and gap <= 0.1
    shape = f"{b.dp}/{b.tp}/{b.pp}x{b.interleave} mb{b.micro_batch} L{b.optimizer_level} {b.recompute}"
    search = "free" if free else "as published"
    return (
        f"{case.source[:10]:10} {case.label:18} {search:12} {best.result.iteration_s:8.3f} {shape:32} "
        f"{published.iteration_s:8.3f} {rank:4} {gap:6.1%} {'yes' if beats else 'no':5} {'yes' if ok else 'no':4} {found.seconds:5.1f}"
    )


def quality_table() -> None:
    """The plan-quality table over both papers' rows (see the module docstring)."""
    from loom.sim.validation import cases

    print(f"{'source':10} {'row':18} {'search':12} {'best s':>8} {'best dp/tp/pp':32} {'pub s':>8} "
          f"{'rank':>4} {'gap':>6} {'beats':5} {'ok':4} {'time':>5}")  # fmt: skip
    for case in cases():
        if case.source in QUALITY_SOURCES:
            for free in (True, False):
                print(_quality_row(case, free), flush=True)
    print("beats: best >= published throughput; ok: beats, published rank <= 10 and within 10% of the best")


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
    coarse_search_time()
    quality_table()
    if "--outer" not in sys.argv:
        operator_level()


def operator_level() -> None:
    """Capture once, then the operator-level search on each mesh of `MESHES`."""
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
