"""Fit the cost model's efficiency constants (`loom.cost.efficiency`) on the fit half of the published runs.

The objective is the mean squared log ratio predicted / published over the fit half's cases: log ratios
weigh an over- and an under-prediction by the same factor alike, and no row's metric scale matters. It is
minimised by coordinate descent: a golden-section search on one constant at a time within its
`FIT_BOUNDS`, the others held, for a few sweeps (the objective is smooth and nearly separable: each
constant prices one kind of work). numpy only; no per-row term exists to fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from loom.cost import efficiency
from loom.cost.hardware import Cluster
from loom.sim.simulator import simulate
from loom.sim.validation import Case

__all__ = ["CURRENT", "apply", "fit", "log_errors", "relative_error"]

# the constants as `loom.cost.efficiency` holds them now, under the fit's names
CURRENT = {
    "matmul_a100": efficiency.MATMUL_EFFICIENCY["a100"],
    "matmul_h100": efficiency.MATMUL_EFFICIENCY["h100"],
    "fp8_matmul": efficiency.FP8_MATMUL_EFFICIENCY,
    "attention_a100": efficiency.ATTENTION_EFFICIENCY["a100"],
    "attention_h100": efficiency.ATTENTION_EFFICIENCY["h100"],
    "cudnn_attention_h100": efficiency.CUDNN_ATTENTION_EFFICIENCY["h100"],
    "memory": efficiency.MEMORY_EFFICIENCY,
    "link": efficiency.LINK_EFFICIENCY,
    "host_kernel_us": efficiency.HOST_KERNEL_S * 1e6,
    "matmul_knee": efficiency.MATMUL_KNEE,
}
GOLDEN = (math.sqrt(5) - 1) / 2


def apply(cluster: Cluster, constants: dict[str, float]) -> Cluster:
    """`cluster` with its efficiencies set from `constants` (the GPU generation picks its matmul constant)."""
    generation = "h100" if cluster.device.name.startswith(("h100", "h200")) else "a100"
    device = dataclasses.replace(
        cluster.device,
        matmul_efficiency=constants[f"matmul_{generation}"],
        fp8_efficiency=constants["fp8_matmul"],
        attention_efficiency=constants[f"attention_{generation}"],
        cudnn_attention_efficiency=constants["cudnn_attention_h100"] if generation == "h100" else None,
        memory_efficiency=constants["memory"],
        host_kernel_s=constants["host_kernel_us"] * 1e-6,
        matmul_knee=constants["matmul_knee"],
    )
    intra = dataclasses.replace(cluster.intra, efficiency=constants["link"])
    inter = dataclasses.replace(cluster.inter, efficiency=constants["link"])
    return dataclasses.replace(cluster, device=device, intra=intra, inter=inter)


def relative_error(case: Case, constants: dict[str, float]) -> float:
    """predicted / published - 1 for `case` under `constants`."""
    result = simulate(case.model, case.plan, apply(case.cluster, constants))
    return getattr(result, case.metric) / case.published - 1


def log_errors(cases: Sequence[Case], constants: dict[str, float]) -> list[float]:
    """log(predicted / published) of every case; a time per iteration is turned into a rate first, so
    that every log ratio says how much too fast (positive) or too slow the simulator predicts a run."""
    out = []
    for case in cases:
        ratio = 1 + relative_error(case, constants)
        out.append(-math.log(ratio) if case.metric == "iteration_s" else math.log(ratio))
    return out


def _golden(objective: Callable[[float], float], low: float, high: float, steps: int) -> float:
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = objective(d)
    return (a + b) / 2


def fit(
    cases: Sequence[Case], start: dict[str, float] | None = None, *, sweeps: int = 3, steps: int = 10
) -> dict[str, float]:
    """The constants minimising the mean squared log error over `cases` (see the module's docstring)."""
    constants = dict(start or CURRENT)

    def loss(name: str, value: float) -> float:
        errors = log_errors(cases, constants | {name: value})
        return sum(e * e for e in errors) / len(errors)

    for _ in range(sweeps):
        for name, (low, high) in efficiency.FIT_BOUNDS.items():
            constants[name] = round(_golden(lambda v, n=name: loss(n, v), low, high, steps), 3)
    return constants
