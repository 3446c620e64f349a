"""Optimizer levels 1-3 for a pipeline rank's stages: states (level 2: also gradients; level 3: also
parameters) sharded over the ranks that run the same stages (the stage's data-parallel replicas, or with
tensor parallelism its stage mesh), never over pipeline ranks, which hold other stages.

`ZeroOptimizer` shards its states over the buckets of the pipeline's one `GradSync` (see
`loom.parallel.pipeline.reduction`), which reduces them while each stage's last backward runs (reduce-scattered at
levels 2-3). A tied parameter's bucket spans the ranks that hold its copies, so its chunks are cut alike on
each of them and its copies take the same update. At level 3 each stage is gathered around each of its
pieces of work inside the schedule (`Pipeline.shard_parameters`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.parallel.pipeline.schedule import Pipeline
from loom.parallel.zero import ZeroOptimizer


def stages_optimizer(
    pipeline: Pipeline,
    optimizer_class: Callable[..., torch.optim.Optimizer],
    level: int = 0,
    **hyper,
) -> torch.optim.Optimizer:
    """The optimizer of `pipeline`'s parameters at optimizer level `level` (`loom.parallel.make_optimizer`
    calls it for a pipeline): 0 (or a stage run by one rank alone, where there is nothing to shard over) a
    plain `optimizer_class`; 1-3 a `ZeroOptimizer` over this rank's stages, on the buckets in which the
    pipeline reduces their gradients."""
    if level == 0 or pipeline.stage_ranks() == 1:
        return optimizer_class(pipeline.parameters(), **hyper)
    assert pipeline.grad_sync is not None, "stages run by several ranks reduce their gradients"
    modules = nn.ModuleList(pipeline.modules)
    sharding = pipeline.shard_parameters() if level == 3 else None
    return ZeroOptimizer(
        modules, optimizer_class, level, grad_sync=pipeline.grad_sync, sharding=sharding, **hyper
    )
