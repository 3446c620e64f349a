"""`loom train` with `[parallel] sync = "local_sgd"` or `"diloco"`: data-parallel replicas that step alone and
meet every `sync_every` steps (`loom.parallel.local_sgd`), for replicas joined by slow links.

Each replica is the ranks that share a data-parallel index: one process at `tp = 1`, else its `tp` ranks,
laid out tensor-parallel on a mesh of their own (`replica_mesh`), so that nothing in a step leaves the
replica: its gradients are not reduced over dp, and the step's loss, gradient norm and finiteness are the
replica's (`replica_group`, the Trainer's `group`). The optimizer `[train]` describes becomes the inner
optimizer of a `LocalSGD` or `DiLoCo` over the ranks of the other replicas that hold the same shards
(`outer_group`), which issues the only collectives between replicas, at the syncs. Checkpoints keep each
rank's parameters and optimizer states (`loom.checkpoint.state.replica_state`), so a resumed run continues
exactly.

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
from loom.models.gpt import GPT
from loom.parallel.local_sgd import DiLoCo, LocalSGD, Replicated
from loom.recompute import recompute
from loom.train.config import TrainConfig

__all__ = [
    "join_replicas",
    "outer_group",
    "replica_group",
    "replica_mesh",
    "replica_optimizer",
    "replica_plan_text",
    "whole_replica_model",
]

_OUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def replica_mesh(mesh: loom.Mesh) -> loom.Mesh | None:
    """The mesh of this rank's replica (the ranks of its dp index): None for one process, the whole mesh
    for one replica."""
    if mesh.world_size == mesh.dp_size:
        return None
    return mesh if mesh.dp_size == 1 else mesh.without("dp")


def replica_group(mesh: loom.Mesh) -> dist.ProcessGroup | None:
    """The process group of this rank's replica (collective on first use: every rank builds every group)."""
    return mesh.group({"tp": None} if mesh.axis_size("tp") > 1 else {})


def outer_group(mesh: loom.Mesh) -> dist.ProcessGroup | None:
    """The ranks this rank meets at a sync: one per replica, each holding the same shards (same tp index)."""
    return mesh.group({"dp": None})


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
    model: nn.Module,
    inner: torch.optim.Optimizer,
    mesh: loom.Mesh,
    membership: Membership | None = None,
) -> Replicated:
    """`[parallel] sync`'s optimizer around `inner` (the optimizer `[train]` describes) over `mesh`'s
    replicas, or over `membership`'s (replicas that come and go)."""
    par = config.parallel
    group = outer_group(mesh) if membership is None else membership
    params = [p for p in model.parameters() if p.requires_grad]
    if par.sync == "local_sgd":
        return LocalSGD(params, inner, sync_every=par.sync_every, group=group)
    # Nesterov needs a momentum: without one the outer step is plain SGD (lr 1: the average as it is)
    outer = {"lr": par.outer_lr, "momentum": par.outer_momentum, "nesterov": par.outer_momentum > 0}
    return DiLoCo(
        params, inner, sync_every=par.sync_every, group=group, outer_kwargs=outer, fragments=par.fragments,
        fragment_delay=par.fragment_delay, mix=par.mix, outer_dtype=_OUTER_DTYPES[par.outer_dtype],
    )  # fmt: skip


def replica_plan_text(
    config: TrainConfig, model: nn.Module, mesh: loom.Mesh, membership: Membership | None = None
) -> str:
    """The plan of a run whose replicas step alone: how many, of how many ranks, and how they meet (with
    `membership`, replicas of one process that come and go, each on a mesh of its own)."""
    par, m = config.parallel, config.model
    meets = f"{par.sync} every {par.sync_every} steps"
    if par.sync == "diloco":
        meets += f", outer SGD lr {par.outer_lr} momentum {par.outer_momentum}"
        if par.fragments > 1:
            meets += f", {par.fragments} fragments landing {par.fragment_delay} steps later (mix {par.mix})"
        if par.outer_dtype != "fp32":
            meets += f", pseudo-gradients in {par.outer_dtype}"
    each = "one process" if mesh.axis_size("tp") == 1 else f"tp = {par.tp} ranks"
    if membership is not None:
        mesh_text, replicas = f"{membership.size} processes", f"{membership.size} replicas (coming and going)"
    else:
        mesh_text, replicas = str(mesh), f"{mesh.dp_size} replicas"
    count = sum(p.numel() for p in model.parameters())  # this rank's shards
    return "\n".join(
        [
            f"plan: {mesh_text}, {replicas} of {each} stepping alone, meeting by {meets}; precision "
            f"{config.train.precision}, recompute {par.recompute}",
            f"model: {count / 1e6:.2f}M parameters on this rank, {m.n_layers} layers, d_model {m.d_model}, "
            f"{m.n_heads} heads; the loss logged is replica 0's",
        ]
    )


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
