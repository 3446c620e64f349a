"""Optimizer levels 1 and 2 for a pipeline rank's stages: states (and at level 2 gradients) sharded over the
ranks that run the same stages (the stage's data-parallel replicas, or with tensor parallelism its stage
mesh), never over pipeline ranks, which hold other stages.

One `GradSync` covers all of this rank's stages, with its collectives and its usage agreement on the stage's
ranks alone. Its hooks are removed: a schedule runs a backward pass per micro-batch, so `Pipeline` reduces the
accumulated gradients once after the schedule (`GradSync.reduce_now`: bucketed, not overlapped with the last
backward). `ZeroOptimizer` then shards its states over those buckets. Level 3 (parameters sharded at rest)
is not supported: the schedule runs the stages' modules outside of what `ParameterSharding` hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.grad_sync import GradSync
from loom.parallel.routes import data_parallel_route, dtensor_route, fix_placements
from loom.parallel.zero import LEVELS, ZeroOptimizer
from loom.pipeline.schedule import Pipeline


def pipeline_optimizer(
    pipeline: Pipeline,
    optimizer_class: Callable[..., torch.optim.Optimizer],
    level: int = 0,
    *,
    bucket_mb: float = 25.0,
    **hyper,
) -> torch.optim.Optimizer:
    """The optimizer of `pipeline`'s parameters at optimizer level `level`: 0 (or a stage run by one rank
    alone, where there is nothing to shard over) a plain `optimizer_class`; 1 and 2 a `ZeroOptimizer` over
    this rank's stages, whose gradients the pipeline then reduces in its buckets."""
    if level not in LEVELS:
        raise ValueError(f"optimizer level {level}; loom supports {LEVELS}")
    if level == 3:
        raise ValueError(
            "optimizer level 3 is not supported with pipelines: the schedule runs the stages outside the "
            "parameter gathering that level 3 hooks; use parallel.optimizer_level = 2 (states and gradients "
            "sharded) or pp = 1"
        )
    if level == 0 or pipeline.stage_ranks() == 1:
        return optimizer_class(pipeline.parameters(), **hyper)
    sync = stage_grad_sync(pipeline, bucket_mb)
    pipeline.grad_sync = sync
    return ZeroOptimizer(nn.ModuleList(pipeline.modules), optimizer_class, level, grad_sync=sync, **hyper)


def stage_grad_sync(pipeline: Pipeline, bucket_mb: float = 25.0) -> GradSync:
    """A hookless `GradSync` over this rank's stages on the ranks that run them: gradients averaged over the
    data-parallel group (plain stages), or pending sums reduced on the stage mesh (DTensor stages). A tied
    parameter gets buckets of its own, so that its chunks are cut alike on every pipeline rank that holds a
    copy (they take the same update) and a chunk's norm can count its copies."""
    module = nn.ModuleList(pipeline.modules)
    if pipeline.mesh is None:
        group = pipeline.dp_group
        sync = GradSync(module, data_parallel_route(group), bucket_mb, group=group)
    else:
        mesh = pipeline.mesh
        group = mesh.sub_mesh(tuple(range(mesh.ndim))).get_group()
        sync = GradSync(module, dtensor_route(mesh), bucket_mb, group=group)
        sync.after_sync = fix_placements(sync.params)  # as ParallelState.materialize sets it
    sync.remove()  # reduced once after the schedule (`Pipeline.sync_gradients`), not per backward pass
    for tied in pipeline.tied:
        if tied.param is not None:
            sync.unit_of[tied.param] = 1
    if sync.static is not None:
        sync.rebuild_static()
    assert dist.get_world_size(group) == pipeline.stage_ranks()
    return sync
