"""`PipelineTrainer`: the Trainer's step with a pipeline schedule in place of forward and backward.

One step: each of the step's batches (the Trainer's micro-batches, `grad_accum` of them) runs through
`Pipeline.run`, which cuts it again into the pipeline's micro-batches and runs the schedule; gradients
accumulate, weighted by 1/batches (times the loss scale in fp16), and the last batch's last backward passes
reduce them over the stages' data-parallel replicas; the step's loss takes one collective. The rest of the step is the Trainer's own (`Trainer._update`): the
global gradient norm over every stage, clipping, the non-finite skip, the optimizer step on this rank's
stage parameters, the loss scale and the learning rate, the callbacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist import env
from loom.dist.context import unsharded
from loom.parallel.grads import GradView, grad_views
from loom.parallel.pipeline import Pipeline
from loom.parallel.zero import ZeroOptimizer
from loom.train.precision import autocast
from loom.train.trainer import Trainer


class PipelineTrainer(Trainer):
    """Trains `pipeline` (this rank's stages; see `loom.parallel.pipeline.gpt_pipeline`) with `optimizer` over its
    parameters. Takes the Trainer's options (`grad_accum`, `clip_grad_norm`, `precision`, `callbacks`, ...);
    each of `train_step`'s micro-batches is an `(inputs, targets)` pair that the pipeline cuts again into
    its own micro-batches. `model` is what `trainer.model` shows (checkpoints save its `state_dict`): by
    default the stages; `loom.parallel.pipeline.stage_parameters` gives them the whole model's names. Every rank of
    the world runs one pipeline rank (world = pp x dp x tp), so sums over the world (the gradient norm, the
    finiteness check) cover every stage once per replica. Stages laid out on a stage mesh (tp > 1) run with
    that mesh current (`Pipeline` sets it inside the `unsharded` block).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module | None = None,
        **options: object,
    ) -> None:
        super().__init__(model or nn.ModuleList(pipeline.modules), optimizer, **options)  # type: ignore
        self.pipeline = pipeline
        self.replicas = dist.get_world_size(pipeline.dp_group) if pipeline.dp_group is not None else 1
        if pipeline.pp * pipeline.stage_ranks() != env.world_size():
            raise ValueError(
                f"PipelineTrainer: pp {pipeline.pp} x {pipeline.stage_ranks()} ranks per stage do not make the "
                f"world of {env.world_size()}: every rank must hold one pipeline rank"
            )

    def _forward_backward(self, micro_batches: Sequence[tuple]) -> float:
        count = len(micro_batches)
        weight = (self.scaler.scale if self.scaler else 1.0) / count
        losses = []
        # unsharded: the stages' operators compute on this process alone, also when recomputed in backward
        with unsharded(), autocast(self.precision, env.device_type()):
            for index, (inputs, targets) in enumerate(micro_batches):
                losses.append(self.pipeline.run(inputs, targets, weight=weight, sync=index == count - 1))
        return self.pipeline.global_loss(losses)

    def _eval_loss(self, batches: Iterable[tuple]) -> float:
        with unsharded(), autocast(self.precision, env.device_type()):
            losses = [self.pipeline.run_eval(inputs, targets) for inputs, targets in batches]
        return self.pipeline.global_loss(losses) if losses else float("nan")

    def _grad_views(self) -> list[GradView]:
        """This rank's stage gradients; the same values sit on the stage's data-parallel replicas (a DTensor
        gradient: on the stage mesh's ranks it is replicated over) and, for a tied parameter, on the other
        pipeline rank that holds a copy. Only this pipeline rank's stage mesh holds these stages, so the
        world-wide sum of the norm counts every element once. At optimizer level 2 the gradients are the
        chunks of the stages' buckets (a tied parameter's bucket spans every rank holding a copy, so each of
        its chunks sits on one rank of it)."""
        if isinstance(self.optimizer, ZeroOptimizer) and self.optimizer.level >= 2:
            chunks = [
                GradView(bucket.shard_grad, bucket.route.copies)
                for bucket in self.optimizer.sync.buckets
                if bucket.shard_grad is not None
            ]
            return chunks + self._param_views(self.optimizer.whole_params())
        return self._param_views(self.params)

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
