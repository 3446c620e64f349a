"""Tensor parallelism inside pipeline stages: each stage laid out on its stage mesh.

A stage mesh is the dp x tp ranks that share a pipeline index (`Mesh.without("pp")`), so that no collective
of a stage spans pipeline ranks (which hold other stages). torch's schedules move plain tensors between
stages: a stage's input is this rank's piece of the residual stream (its rows of the batch, whole along
"tp"), made a DTensor on entry, and its output this rank's piece again (`BlockStage.boundary`).

Any model: its stages are laid out by `loom.parallelize` with a module plan (a recipe's `tensor_plan`)
whose patterns are matched against the whole model's module paths, so the plan written for the model
applies to each stage's share of it. The last stage's loss runs on the DTensor logits, under the lifting of
plain tensors (`loom.parallel.lift`), so that a vocabulary cut by the head stays cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from loom.dist.mesh import Mesh
from loom.parallel.lift import LiftPlainTensors
from loom.parallel.parallelize import parallelize_part

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stream_placements(mesh: Mesh, sequence_parallel: bool) -> tuple[Placement, ...]:
    """Placements of a (batch, seq, ...) activation on a stage mesh: rows cut over "dp" and "cp" (each cp
    rank's piece of the sequences is a row of its own, as `parallelize` takes the batch), the sequence cut
    over "tp" with sequence parallelism (else whole on every tp rank)."""
    rows = set(mesh.batch_dims) | (
        set(mesh.shape.canonical_dims_of("cp")) if "cp" in mesh.shape.names else set()
    )
    cut = set(mesh.shape.canonical_dims_of("tp")) if sequence_parallel else set()
    return tuple(Shard(0) if d in rows else Shard(1) if d in cut else Replicate() for d in range(mesh.ndim))


def enter_stream(mesh: Mesh, placements: tuple[Placement, ...]):
    """A forward pre-hook: the received local piece of the residual stream becomes the global DTensor."""

    def hook(_: nn.Module, args: tuple) -> tuple:
        (x, *rest) = args
        return (DTensor.from_local(x, mesh.device_mesh, placements, run_check=False), *rest)

    return hook


def lay_out_stages(
    model: nn.Module, stages: Sequence[nn.Module], mesh: Mesh, module_plan: Mapping[str, Any], ep: int = 1
) -> None:
    """Lay each of this rank's `stages` (parts of `model`) out on the stage mesh `mesh` by `module_plan`
    (patterns over `model`'s paths), their experts cut over `ep` ranks of its dp. Gradients are left pending: the pipeline's one `GradSync` reduces
    them (see `loom.parallel.pipeline.reduction`)."""
    boundary = stream_placements(mesh, False)
    for stage in stages:
        # a schedule keeps its stages' shapes from run to run (torch sizes the buffers between stages by its
        # first run), so the first stage checks each shape of its input once, not every micro-batch
        parallelize_part(stage, mesh, module_plan=module_plan, root=model, check_once_per_shape=True, ep=ep)
        stage.loom.grad_sync.remove()  # one GradSync serves all of this rank's stages (Pipeline's)
        stage.boundary = boundary
        if not stage.first:  # before parallelize's hook, which would take the stream as plain rows
            stage.register_forward_pre_hook(enter_stream(mesh, boundary), prepend=True)


def local_share(value: torch.Tensor) -> torch.Tensor:
    """A loss on the stage mesh as this rank's plain share of it, without a collective: its local value,
    scaled so that the mean of the shares over the stage mesh's ranks is the global loss (a sum pending
    over mesh dims of n ranks: times n; a pending average or a replicated value: as it is), with the
    gradient `full_tensor()` would give it. `Pipeline.global_loss` sums the shares over the world once per
    step, so each micro-batch's loss needs no reduction of its own."""
    if not isinstance(value, DTensor):
        return value
    placements = value.placements
    grads = tuple(Replicate() if p.is_partial() else p for p in placements)  # as full_tensor's backward
    local = value.to_local(grad_placements=grads)
    summed = math.prod(
        value.device_mesh.size(d) for d, p in enumerate(placements) if p.is_partial() and p.reduce_op == "sum"
    )
    # the scale rides on a detached term: the value is the share, the gradient stays the local loss's
    return local + (local * (summed - 1)).detach() if summed > 1 else local


def sharded_loss(loss_fn: LossFn, mesh: Mesh) -> LossFn:
    """The last stage's loss on a stage mesh: `loss_fn` on the DTensor logits and this rank's rows of the
    targets (made a DTensor like the stream), under the lifting of plain tensors, as this rank's plain
    share of the mean over the micro-batch's rows of every data-parallel replica (`local_share`). Its
    backward gives each replica the gradient of that global mean, so the stages' gradients are summed over
    the replicas."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = DTensor.from_local(
            targets, mesh.device_mesh, stream_placements(mesh, False), run_check=False
        )
        with LiftPlainTensors():
            value = loss_fn(logits, targets)
        return local_share(value)

    return loss
