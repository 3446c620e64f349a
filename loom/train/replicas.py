"""`loom train` with `[parallel] sync = "local_sgd"` or `"diloco"`: data-parallel replicas that step alone and
meet every `sync_every` steps (`loom.parallel.local_sgd`), for replicas joined by slow links.

The world is laid out with an outermost mesh axis "replica" of `parallel.replicas` (default: dp) replicas,
then the run's usual axes (pp, dp, tp) with dp / replicas data-parallel ranks in each replica
(`replicas_mesh_sizes`). A replica's ranks are the mesh without that axis (`replica_mesh`): one process, or
its ranks laid out data-, pipeline- and tensor-parallel on a mesh of their own, so that nothing in a step
leaves the replica: its gradients are reduced over its own dp ranks only (sharded there at optimizer levels
1-3), and the step's loss, gradient norm and finiteness are the replica's (`replica_group`, the Trainer's
`group`). The optimizer `[train]` describes becomes the inner optimizer of a `LocalSGD` or `DiLoCo` over the
ranks of the other replicas at the same coordinates (`outer_group`), which hold the same shards (a pipeline
rank's stages, a tp slice, a ZeRO chunk) and issue the only collectives between replicas, at the syncs.
Checkpoints keep each rank's parameters and optimizer states (`loom.checkpoint.state.replica_state`), so a
resumed run continues exactly.

With `[fault] elastic_replicas` (replicas of one process) the replicas come and go: each worker is a process
group of its own and the syncs are meetings of the replicas alive (`loom.dist.elastic.Membership`); a
replacement enters at the next sync (`join_replicas`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

import loom
from loom.dist.elastic import Membership
from loom.dist.local import local_tensor
from loom.models.gpt import GPT
from loom.parallel.local_sgd import DiLoCo, LocalSGD, Replicated
from loom.parallel.pipeline import Pipeline
from loom.recompute import recompute
from loom.train.config import TrainConfig

__all__ = [
    "REPLICA_AXIS",
    "data_position",
    "join_replicas",
    "outer_group",
    "replica_group",
    "replica_mesh",
    "replica_optimizer",
    "replica_plan_text",
    "replicas_mesh_sizes",
    "whole_replica_model",
]

_OUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# the outermost mesh axis of a run whose replicas step alone: one index per replica
REPLICA_AXIS = "replica"


def replicas_mesh_sizes(config: TrainConfig, world_size: int) -> dict[str, int]:
    """The axes of a run whose replicas step alone, for `loom.init`: "replica" outermost, then the Plan's
    axes (`Plan.mesh_sizes`) with dp / replicas data-parallel ranks inside each replica."""
    sizes = config.plan(world_size).mesh_sizes()
    config.check_replicas(sizes["dp"])  # replicas divides dp (and what it allows inside)
    count = config.parallel.replica_count(sizes["dp"])
    return {REPLICA_AXIS: count, **sizes, "dp": sizes["dp"] // count}


def replica_mesh(mesh: loom.Mesh) -> loom.Mesh | None:
    """The mesh of this rank's replica (the ranks of its "replica" index, with the run's dp, pp and tp axes
    inside): None for a replica of one process."""
    if mesh.world_size == mesh.axis_size(REPLICA_AXIS):
        return None
    return mesh.without(REPLICA_AXIS)


def replica_group(mesh: loom.Mesh) -> dist.ProcessGroup | None:
    """The process group of this rank's replica (collective on first use: every rank builds every group)."""
    return mesh.group({name: None for name in mesh.shape.names if name != REPLICA_AXIS})


def outer_group(mesh: loom.Mesh) -> dist.ProcessGroup | None:
    """The ranks this rank meets at a sync: one per replica, each at this rank's coordinates in its replica
    (the same pipeline rank, dp index and tp index: the same shards)."""
    return mesh.group({REPLICA_AXIS: None})


def data_position(mesh: loom.Mesh) -> tuple[int, int]:
    """This rank's data-parallel index and the data-parallel size, over every replica: replica r's dp
    ranks read rows r * dp ... (r + 1) * dp - 1 of the split (on a mesh without replicas: its dp axis)."""
    inside = (mesh.dp_rank(), mesh.dp_size)
    if REPLICA_AXIS not in mesh.shape.names:
        return inside
    return mesh.axis_rank(REPLICA_AXIS) * inside[1] + inside[0], mesh.axis_size(REPLICA_AXIS) * inside[1]


def whole_replica_model(config: TrainConfig) -> GPT:
    """The GPT of `[model]` whole on this process, for a replica of one process (every replica starts from
    the same weights, seeded by `train.seed`)."""
    model = GPT(config.model.gpt_config())
    model.init_weights(config.train.seed)
    for block in model.blocks:
        recompute(block, config.parallel.recompute)
    return model


def replica_optimizer(
    config: TrainConfig,
    parts: nn.Module | Pipeline,
    inner: torch.optim.Optimizer,
    mesh: loom.Mesh,
    membership: Membership | None = None,
) -> Replicated:
    """`[parallel] sync`'s optimizer around `inner` (the optimizer `[train]` describes, over the model
    `parts`: a module, or this rank's pipeline stages) over `mesh`'s replicas, or over `membership`'s
    (replicas that come and go)."""
    par = config.parallel
    group = outer_group(mesh) if membership is None else membership
    params = [p for p in dict.fromkeys(parts.parameters()) if p.requires_grad]
    if par.sync == "local_sgd":
        return LocalSGD(params, inner, sync_every=par.sync_every, group=group)
    # Nesterov needs a momentum: without one the outer step is plain SGD (lr 1: the average as it is)
    outer = {"lr": par.outer_lr, "momentum": par.outer_momentum, "nesterov": par.outer_momentum > 0}
    return DiLoCo(
        params, inner, sync_every=par.sync_every, group=group, outer_kwargs=outer, fragments=par.fragments,
        fragment_delay=par.fragment_delay, mix=par.mix, outer_dtype=_OUTER_DTYPES[par.outer_dtype],
    )  # fmt: skip


def replica_plan_text(
    config: TrainConfig, parts: nn.Module | Pipeline, mesh: loom.Mesh, membership: Membership | None = None
) -> str:
    """The plan of a run whose replicas step alone: how many, each of what (dp x pp x tp ranks, optimizer
    level, pipeline schedule), and how they meet (with `membership`, replicas of one process that come and
    go, each on a mesh of its own). `parts`: the model, or this rank's pipeline stages."""
    par, m = config.parallel, config.model
    meets = f"{par.sync} every {par.sync_every} steps"
    if par.sync == "diloco":
        meets += f", outer SGD lr {par.outer_lr} momentum {par.outer_momentum}"
        if par.fragments > 1:
            meets += f", {par.fragments} fragments landing {par.fragment_delay} steps later (mix {par.mix})"
        if par.outer_dtype != "fp32":
            meets += f", pseudo-gradients in {par.outer_dtype}"
    if membership is not None:
        mesh_text, replicas = f"{membership.size} processes", f"{membership.size} replicas (coming and going)"
        each = "one process"
    else:
        mesh_text, replicas = str(mesh), f"{mesh.axis_size(REPLICA_AXIS)} replicas"
        each = _replica_text(config, mesh)
    count = sum(local_tensor(p).numel() for p in dict.fromkeys(parts.parameters()))  # this rank's shards
    return "\n".join(
        [
            f"plan: {mesh_text}, {replicas} of {each} stepping alone, meeting by {meets}; precision "
            f"{config.train.precision}, recompute {par.recompute}",
            f"model: {count / 1e6:.2f}M parameters on this rank, {m.n_layers} layers, d_model {m.d_model}, "
            f"{m.n_heads} heads; the loss logged is replica 0's",
        ]
    )


def _replica_text(config: TrainConfig, mesh: loom.Mesh) -> str:
    """What one replica is: "one process", or "dp 2 x pp 2 x tp 1 ranks (..." with its optimizer level and
    its pipeline schedule."""
    if replica_mesh(mesh) is None:
        return "one process"
    par = config.parallel
    dp, pp, tp = (mesh.axis_size(axis) for axis in ("dp", "pp", "tp"))
    inside = [f"optimizer level {par.optimizer_level}"]
    if pp > 1:
        inside.append(f"pipeline schedule {par.schedule} with {par.microbatches} micro-batches")
    return f"dp {dp} x pp {pp} x tp {tp} = {dp * pp * tp} ranks ({', '.join(inside)})"


def join_replicas(trainer: object, batches: object, last_step: int) -> int | None:
    """A replacement replica's entry into the running job: its `LocalSGD` / `DiLoCo` joins the next sync
    (taking the global weights and outer state), then the trainer continues from that step: the schedule
    and the data position (`batches`, a `DistributedBatches`) advanced to it, the inner optimizer fresh.
    Returns the step, or None when no sync is left before `last_step`."""
    step = trainer.optimizer.join(last_step)
    if step is None:
        return None
    trainer.step = step
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # stepped before the optimizer on purpose: the schedule's position
            warnings.simplefilter("ignore")
            trainer.lr_scheduler.step()
    batches.skip(step)
    return step
