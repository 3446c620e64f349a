"""Pipeline stages: mark modules with a stage number (MindSpore style) or partition blocks automatically.

A stage is a contiguous run of blocks. `pipeline_stage(block, k)` (or `block.pipeline_stage = k`) marks a
block by hand; `balanced_partition` cuts a list of costs (parameter counts or measured seconds) into
contiguous parts whose largest cost is as small as possible, because the slowest stage sets the pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

ATTRIBUTE = "pipeline_stage"


def pipeline_stage(module: nn.Module, k: int) -> nn.Module:
    """Put `module` on pipeline stage `k` (0-based); returns the module, so it can wrap a constructor."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"pipeline stage must be a non-negative int, got {k!r}")
    setattr(module, ATTRIBUTE, k)
    return module


def stage_of_blocks(blocks: Sequence[nn.Module]) -> list[int]:
    """The stage of each block, validated: every block marked, stages starting at 0, never decreasing,
    no stage skipped (a block list is run in order, so stage k+1 cannot come before stage k)."""
    stages = []
    for index, block in enumerate(blocks):
        k = getattr(block, ATTRIBUTE, None)
        if k is None:
            raise ValueError(
                f"block {index} ({type(block).__name__}) has no pipeline stage; mark it with "
                f"loom.parallel.pipeline.pipeline_stage(block, k) or block.pipeline_stage = k, or partition the "
                f"blocks automatically with loom.parallel.pipeline.assign_stages(blocks, pp)"
            )
        previous = stages[-1] if stages else -1
        if k < previous or k > previous + 1:
            raise ValueError(
                f"block {index} is on stage {k} after a block on stage {previous}: stages must run "
                f"0, 1, 2, ... in block order without gaps (got {stages + [k]})"
            )
        stages.append(k)
    if stages and stages[0] != 0:
        raise ValueError(f"the first block must be on stage 0, got stage {stages[0]}")
    return stages


def balanced_partition(costs: Sequence[float], parts: int) -> list[int]:
    """The stage of each item: `parts` contiguous non-empty groups minimising the largest group cost
    (dynamic programming over cut points; ties go to the earliest cut)."""
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} blocks into {parts} stages: need 1 <= stages <= blocks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[p][i]: the smallest largest-cost when the first i items form p groups; cut[p][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    stages, i = [0] * n, n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        stages[j:i] = [p - 1] * (i - j)
        i = j
    return stages


def parameter_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """Each block's parameter count."""
    return [float(sum(p.numel() for p in block.parameters())) for block in blocks]


def measured_costs(
    blocks: Sequence[nn.Module],
    sample: torch.Tensor,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    repeats: int = 3,
) -> list[float]:
    """Each block's measured forward+backward seconds (best of `repeats`), feeding each block the previous
    block's output; `call(block, x)` runs a block (default `block(x)`)."""
    call = call or (lambda block, x: block(x))
    costs, x = [], sample
    for block in blocks:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = call(block, inp)
            out.float().sum().backward()
            best = min(best, time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
        costs.append(best)
        x = out.detach()
    return costs


def assign_stages(
    blocks: Sequence[nn.Module],
    pp: int,
    by: str = "parameters",
    sample: torch.Tensor | None = None,
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Mark `blocks` with balanced stages (`by` "parameters" or "time"; "time" needs a `sample` input)."""
    if by == "parameters":
        costs = parameter_costs(blocks)
    elif by == "time":
        if sample is None:
            raise ValueError('assign_stages(by="time") needs a sample input for the first block')
        costs = measured_costs(blocks, sample, call)
    else:
        raise ValueError(f'assign_stages: by={by!r}; choose "parameters" or "time"')
    stages = balanced_partition(costs, pp)
    for block, k in zip(blocks, stages, strict=True):
        pipeline_stage(block, k)
    return stages


def group_blocks(blocks: Sequence[nn.Module]) -> list[list[int]]:
    """Block indices of each stage, from the blocks' validated marks."""
    groups: list[list[int]] = []
    for index, k in enumerate(stage_of_blocks(blocks)):
        if k == len(groups):
            groups.append([])
        groups[k].append(index)
    return groups
