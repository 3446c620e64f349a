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
    """Placements of a (batch, seq, ...) activation on a stage mesh: rows cut over "dp", the sequence cut
    over "tp" with sequence parallelism (else whole on every tp rank)."""
    rows, cut = set(mesh.batch_dims), set(mesh.shape.canonical_dims_of("tp")) if sequence_parallel else set()
    return tuple(Shard(0) if d in rows else Shard(1) if d in cut else Replicate() for d in range(mesh.ndim))


def enter_stream(mesh: Mesh, placements: tuple[Placement, ...]):
    """A forward pre-hook: the received local piece of the residual stream becomes the global DTensor."""

    def hook(_: nn.Module, args: tuple) -> tuple:
        (x, *rest) = args
        return (DTensor.from_local(x, mesh.device_mesh, placements, run_check=False), *rest)

    return hook


def lay_out_stages(
    model: nn.Module, stages: Sequence[nn.Module], mesh: Mesh, module_plan: Mapping[str, Any]
) -> None:
    """Lay each of this rank's `stages` (parts of `model`) out on the stage mesh `mesh` by `module_plan`
    (patterns over `model`'s paths). Gradients are left pending: the pipeline's one `GradSync` reduces
    them (see `loom.parallel.pipeline.reduction`)."""
    boundary = stream_placements(mesh, False)
    for stage in stages:
        parallelize_part(stage, mesh, module_plan=module_plan, root=model)
        stage.loom.grad_sync.remove()  # one GradSync serves all of this rank's stages (Pipeline's)
        stage.boundary = boundary
        if not stage.first:  # before parallelize's hook, which would take the stream as plain rows
            stage.register_forward_pre_hook(enter_stream(mesh, boundary), prepend=True)


def sharded_loss(loss_fn: LossFn, mesh: Mesh) -> LossFn:
    """The last stage's loss on a stage mesh: `loss_fn` on the DTensor logits and this rank's rows of the
    targets (made a DTensor like the stream), under the lifting of plain tensors, as a plain scalar: the
    mean over the micro-batch's rows of every data-parallel replica. Its backward gives each replica the
    gradient of that global mean, so the stages' gradients are summed over the replicas."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = DTensor.from_local(
            targets, mesh.device_mesh, stream_placements(mesh, False), run_check=False
        )
        with LiftPlainTensors():
            value = loss_fn(logits, targets)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss
