"""How a step's forward and backward run, for each kind of model parts the one `Trainer` trains.

A run is a list of model parts: one module without pipelines (`ModuleSteps`), or this rank's pipeline
stages (`PipelineSteps`). Each gives the Trainer three things: the step's forward and backward over its
micro-batches (returning the global loss), the evaluation loss, and the gradients as this rank holds them
(for the global norm). Everything else in a step (unscaling, the non-finite skip, clipping, the optimizer
step, the loss scale, the learning rate, the callbacks) is the Trainer's own, the same for both.

Pipelines: each of the step's batches (the Trainer's micro-batches, `grad_accum` of them) runs through
`Pipeline.run`, which cuts it again into the pipeline's micro-batches and runs the schedule; gradients
accumulate, weighted by 1/batches (times the loss scale in fp16), and the last batch's last backward passes
reduce them over the stages' data-parallel replicas; the step's loss takes one collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist import env
from loom.dist.context import unsharded
from loom.models.moe import aux_losses
from loom.parallel.grads import GradView, grad_views
from loom.parallel.local_sgd import stepping_optimizer
from loom.parallel.pipeline import Pipeline
from loom.parallel.zero import ZeroOptimizer
from loom.train.precision import autocast

if TYPE_CHECKING:
    from loom.train.trainer import Trainer

__all__ = ["ModuleSteps", "PipelineSteps", "global_mean", "mean_loss", "steps_for"]


def steps_for(
    parts: nn.Module | Pipeline, group: dist.ProcessGroup | None = None
) -> ModuleSteps | PipelineSteps:
    """The step engine of `parts`: a module (one part) or a `Pipeline` (this rank's stages), trained by the
    ranks of `group` (default: every rank)."""
    return PipelineSteps(parts, group) if isinstance(parts, Pipeline) else ModuleSteps(parts)


class ModuleSteps:
    """One module made parallel by `loom.parallelize` (or a plain one): its forward takes one micro-batch
    and returns the mean loss over it. The balancing losses of its mixtures of experts
    (`loom.models.moe.aux_losses`) are added to what backward differentiates; the loss reported is the
    model's own."""

    def __init__(self, model: nn.Module) -> None:
        self.module = model

    def forward_backward(self, trainer: Trainer, micro_batches: Sequence[tuple]) -> torch.Tensor:
        """Accumulate the (scaled) gradients of the step's mean loss; returns that loss, global, on the
        device (read it later: reading it syncs)."""
        count = len(micro_batches)
        losses = []
        scale = trainer.scaler.scale if trainer.scaler else 1.0
        for index, batch in enumerate(micro_batches):
            # gradients accumulate locally and are reduced once, in the last micro-batch's backward
            with self._sync_gradients(index == count - 1):
                with autocast(trainer.precision, trainer.device.type):
                    loss = self.module(*batch)
                # mixtures of experts: their balancing losses join the gradient, not the reported loss
                aux = aux_losses(self.module)
                ((loss if aux is None else loss + aux) * (scale / count)).backward()
            losses.append(loss.detach())
        return mean_loss(losses, trainer.group)

    def eval_loss(self, trainer: Trainer, batches: Iterable[tuple]) -> float:
        """The mean loss over `batches`, global."""
        losses = []
        for batch in batches:
            with autocast(trainer.precision, trainer.device.type):
                losses.append(self.module(*batch))
        return global_mean(losses, trainer.group)

    def grad_views(self, trainer: Trainer) -> list[GradView]:
        """The step's gradients as this rank holds them (a sharding optimizer knows its own pieces)."""
        own = getattr(stepping_optimizer(trainer.optimizer), "grad_views", None)
        return own() if own is not None else grad_views(trainer.params, trainer.group)

    def balance_group(self) -> dist.ProcessGroup | None:
        """The ranks whose tokens the experts' balancing biases are moved by: every rank (None alone)."""
        return dist.group.WORLD if dist.is_initialized() else None

    def _sync_gradients(self, last: bool):
        state = getattr(self.module, "loom", None)
        if last or state is None:
            return contextlib.nullcontext()
        return state.no_sync()


def global_mean(losses: Sequence, group: dist.ProcessGroup | None = None) -> float:
    """The mean of per-micro-batch losses as one global number (see `mean_loss`; reads the device)."""
    return mean_loss(losses, group).item()


def mean_loss(losses: Sequence, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean of per-micro-batch losses, global, as a 0-d fp32 tensor left on the device (no host
    synchronisation): DTensor losses are global already; plain (data-parallel) losses are local and
    averaged over the ranks of `group` (default: the world)."""
    if not losses:
        return torch.tensor(float("nan"))
    if isinstance(losses[0], DTensor):
        return torch.stack([loss.full_tensor() for loss in losses]).float().mean()
    mean = torch.stack(losses).float().mean()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(mean, group=group)
        mean /= dist.get_world_size(group)
    return mean


class PipelineSteps:
    """This rank's pipeline stages (`loom.parallel.pipeline.model_pipeline` or `gpt_pipeline`): each of the
    step's micro-batches is an `(inputs, targets)` pair that the pipeline cuts again into its own
    micro-batches. Every rank of `group` (default: the world) runs one pipeline rank (group = pp x dp x
    tp), so sums over it (the loss, the gradient norm, the finiteness check) cover every stage once per
    data-parallel replica. Stages laid out on a stage mesh (tp > 1) run with that mesh (`Pipeline` passes it
    inside the `unsharded` block)."""

    def __init__(self, pipeline: Pipeline, group: dist.ProcessGroup | None = None) -> None:
        ranks = dist.get_world_size(group) if group is not None else env.world_size()
        if pipeline.pp * pipeline.stage_ranks() != ranks:
            raise ValueError(
                f"Trainer: pp {pipeline.pp} x {pipeline.stage_ranks()} ranks per stage do not make the "
                f"{ranks} ranks that train the model: every rank must hold one pipeline rank"
            )
        self.pipeline, self.group = pipeline, group
        self.module = nn.ModuleList(pipeline.modules)
        self.replicas = dist.get_world_size(pipeline.dp_group) if pipeline.dp_group is not None else 1

    def forward_backward(self, trainer: Trainer, micro_batches: Sequence[tuple]) -> float:
        """Each micro-batch through the schedule; returns the step's loss, global."""
        count = len(micro_batches)
        weight = (trainer.scaler.scale if trainer.scaler else 1.0) / count
        losses = []
        # unsharded: the stages' operators compute on this process alone, also when recomputed in backward
        with unsharded(), autocast(trainer.precision, trainer.device.type):
            for index, (inputs, targets) in enumerate(micro_batches):
                losses.append(self.pipeline.run(inputs, targets, weight=weight, sync=index == count - 1))
        return self.pipeline.global_loss(losses, self.group)

    def eval_loss(self, trainer: Trainer, batches: Iterable[tuple]) -> float:
        """The schedule's forward only over `batches`; the mean loss, global."""
        with unsharded(), autocast(trainer.precision, trainer.device.type):
            losses = [self.pipeline.run_eval(inputs, targets) for inputs, targets in batches]
        return self.pipeline.global_loss(losses, self.group) if losses else float("nan")

    def grad_views(self, trainer: Trainer) -> list[GradView]:
        """This rank's stage gradients; the same values sit on the stage's data-parallel replicas (a DTensor
        gradient: on the stage mesh's ranks it is replicated over) and, for a tied parameter, on the other
        pipeline rank that holds a copy. Only this pipeline rank's stage mesh holds these stages, so the
        world-wide sum of the norm counts every element once. At optimizer level 2 the gradients are the
        chunks of the stages' buckets (a tied parameter's bucket spans every rank holding a copy, so each of
        its chunks sits on one rank of it)."""
        optimizer = stepping_optimizer(trainer.optimizer)
        if isinstance(optimizer, ZeroOptimizer) and optimizer.level >= 2:
            chunks = [
                GradView(bucket.shard_grad, bucket.route.copies)
                for bucket in optimizer.sync.buckets
                if bucket.shard_grad is not None
            ]
            return chunks + self._param_views(optimizer.whole_params())
        return self._param_views(trainer.params)

    def balance_group(self) -> dist.ProcessGroup | None:
        """The ranks whose tokens this rank's experts' balancing biases are moved by: those that run its
        stages (other pipeline ranks hold other layers)."""
        return self.pipeline.stage_group

    def _param_views(self, params: Iterable[nn.Parameter]) -> list[GradView]:
        """The views of whole parameters' gradients (see `_grad_views`)."""
        views = []
        for param in params:
            if param.grad is None:
                continue
            holders = self.pipeline.holders(param)
            if isinstance(param.grad, DTensor):
                (view,) = grad_views([param])
                views.append(GradView(view.local, view.copies * holders))
            else:
                views.append(GradView(param.grad, self.replicas * holders))
        return views
