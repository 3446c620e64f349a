"""Schedules by name and `Pipeline`, one rank's part of a pipeline run over torch's schedules.

| name          | torch schedule                | stages per rank  | placement of stage s       |
|---------------|-------------------------------|------------------|----------------------------|
| "gpipe"       | ScheduleGPipe                 | 1                | rank s                     |
| "1f1b"        | Schedule1F1B                  | 1                | rank s                     |
| "interleaved" | ScheduleInterleaved1F1B       | virtual (>= 2)   | rank s % pp (looped)       |
| "zero_bubble" | ScheduleInterleavedZeroBubble | virtual (>= 1)   | rank s % pp (looped)       |
| "zbv"         | ScheduleZBVZeroBubble         | 2                | V: rank s, then 2pp-1-s    |

The zero-bubble schedules split each backward into the input gradient (sent upstream at once) and the
weight gradient (run later, in what would have been a bubble). The loss is computed on the last stage,
averaged over the micro-batches (each weighted by 1/micro-batches in backward), broadcast to every rank of
the pipeline and averaged over the data-parallel replicas, so `step` returns the global loss on every rank;
gradients are those of that mean.

Stages laid out on a stage mesh (tensor parallelism inside stages; `mesh`) run with that mesh current;
their gradients (DTensors) are left pending by backward and reduced once after the batch, by route (one
all-reduce per group of mesh dims, as `loom.parallelize` would), then given their parameters' placements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from loom.dist.context import use_mesh
from loom.dist.mesh import Mesh
from loom.parallel.grad_sync import GradSync
from loom.parallel.routes import dtensor_route, fix_placements
from loom.pipeline.stage import TimedStage
from loom.pipeline.timeline import Recorder


@dataclass(frozen=True, kw_only=True)
class ScheduleKind:
    """How a named schedule runs: torch's class, whether it takes several stages, how stages are placed."""

    cls: type
    multi: bool
    placement: str  # "single", "loop" or "v"
    min_virtual: int = 1
    max_virtual: int | None = None


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(cls=ScheduleGPipe, multi=False, placement="single", max_virtual=1),
    "1f1b": ScheduleKind(cls=Schedule1F1B, multi=False, placement="single", max_virtual=1),
    "interleaved": ScheduleKind(cls=ScheduleInterleaved1F1B, multi=True, placement="loop", min_virtual=2),
    "zero_bubble": ScheduleKind(cls=ScheduleInterleavedZeroBubble, multi=True, placement="loop"),
    "zbv": ScheduleKind(cls=ScheduleZBVZeroBubble, multi=True, placement="v", min_virtual=2, max_virtual=2),
}


def schedule_kind(name: str, virtual: int) -> ScheduleKind:
    """The named schedule, checked against the number of stages per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    kind = SCHEDULES[name]
    top = kind.max_virtual
    if virtual < kind.min_virtual or (top is not None and virtual > top):
        allowed = f"{kind.min_virtual}" + ("" if top == kind.min_virtual else f"..{top or 'any'}")
        raise ValueError(f"schedule {name!r} takes {allowed} stages per rank (virtual), got {virtual}")
    return kind


def stage_indices(name: str, pp_rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The stages (0 .. pp*virtual-1) that pipeline rank `pp_rank` holds, in the order `Pipeline` takes."""
    kind = schedule_kind(name, virtual)
    if kind.placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


@dataclass(frozen=True, kw_only=True)
class Tied:
    """A parameter that several pipeline ranks hold a copy of (a GPT's tied embedding: the lookup table on
    the first stage, the output head on the last). The copies start equal and stay equal, because their
    gradients are summed over the pipeline after backward. `param` is None on a rank without a copy (it
    then sends zeros of `shape` and `dtype`, this rank's local shape); `holders` is how many ranks of a
    pipeline hold one."""

    param: nn.Parameter | None
    shape: torch.Size
    dtype: torch.dtype
    holders: int


def validate_microbatches(microbatches: int, pp: int) -> None:
    """At least one micro-batch per pipeline rank, or the pipeline never fills."""
    if microbatches < pp:
        raise ValueError(
            f"{microbatches} micro-batches for {pp} pipeline stages: a pipeline needs at least as many "
            f"micro-batches as stages (use >= {pp}; 4x the stages keeps the bubble small)"
        )


class Pipeline:
    """This rank's stages of a pipeline and the schedule that runs them.

    `modules` are this rank's stage modules, in the order of `stage_indices(schedule, pp_rank, pp,
    virtual)`. Each takes the previous stage's output (the first: the model inputs) and the last returns
    what `loss_fn(output, target)` takes. `group` is the pipeline's process group (default: the world);
    `dp_group` the data-parallel replicas of these stages, whose gradients and losses are averaged. `tied`
    lists the parameters that several stages share (see `Tied`). `mesh`: the stage mesh (dp x tp ranks
    of this pipeline rank) when the stages are laid out on it; their losses are then global already and
    their gradients reduced by their pending sums (see the module's docstring).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        *,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        recorder: Recorder | None = None,
        tied: Sequence[Tied] = (),
        mesh: Mesh | None = None,
    ) -> None:
        self.pp, self.pp_rank = dist.get_world_size(group), dist.get_rank(group)
        kind = schedule_kind(schedule, len(modules))
        validate_microbatches(microbatches, self.pp)
        indices = stage_indices(schedule, self.pp_rank, self.pp, len(modules))
        total = self.pp * len(modules)
        self.stages = [
            TimedStage(m, k, total, group=group, recorder=recorder)
            for m, k in zip(modules, indices, strict=True)
        ]
        self.group, self.dp_group, self.microbatches, self.mesh = group, dp_group, microbatches, mesh
        self.modules = list(modules)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.last_rank = 0 if kind.placement == "v" else self.pp - 1
        self.kind = kind
        self.loss_fn = loss_fn
        self.tied = list(tied)
        # set by `loom.pipeline.optimizer` at optimizer levels 1-2: it reduces the gradients in its buckets
        self.grad_sync: GradSync | None = None
        self._weight = 1.0
        # scale_grads=False: the loss is weighted instead (`_weighted_loss`), because torch's scaling divides
        # whatever `.grad` holds, which would also shrink gradients accumulated by earlier `step` calls
        self.schedule = kind.cls(
            self.stages if kind.multi else self.stages[0],
            n_microbatches=microbatches,
            loss_fn=self._weighted_loss,
            scale_grads=False,
        )

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of all its stages; one that two of them share, once)."""
        return list(dict.fromkeys(p for m in self.modules for p in m.parameters()))

    def holders(self, param: nn.Parameter) -> int:
        """How many ranks of the pipeline hold a copy of `param` (1 unless it is tied)."""
        return next((t.holders for t in self.tied if t.param is param), 1)

    def _weighted_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self._weight

    def step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        weight: float = 1.0,
        sync: bool = True,
    ) -> float:
        """Forward and backward of one batch (split into the micro-batches on dim 0); returns the global mean
        loss on every rank. Only the rank with the first stage reads `inputs`, only the one with the last
        reads `targets`.

        Gradients of `weight` times the mean loss accumulate into `.grad` (a trainer accumulating several
        batches passes 1/batches, times its loss scale); with `sync` (the last batch of a step) the
        accumulated gradients are then averaged over the data-parallel replicas.
        """
        self._weight = weight / self.microbatches
        loss = self._run(self.schedule.step, inputs, targets)
        if sync and self.grad_sync is not None and self.grad_sync.shard_gradients:
            # tied copies first: a sharded reduction keeps only chunks, which the copies no longer hold whole
            self.sum_tied_gradients()
            self.sync_gradients()
        elif sync:  # replicas first: a tied table's copies are then laid out alike on both pipeline ranks
            self.sync_gradients()
            self.sum_tied_gradients()
        return loss

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """The global mean loss of one batch, forward only (the same schedule without its backward)."""
        if self.kind.placement == "v":
            raise NotImplementedError(
                "evaluating a zbv pipeline is not supported: torch's ScheduleZBVZeroBubble has no "
                "forward-only path (its eval fails in torch 2.13); evaluate with another schedule"
            )
        self._weight = 1.0
        return self._run(self.schedule.eval, inputs, targets)

    def _run(self, call: Callable, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        with use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            call(*args, **({"target": targets, "losses": losses} if self.has_last else {}))
        # the schedule keeps the weighted losses: unweight their mean (fp32, as the other ranks receive it)
        loss = (
            torch.stack(losses).detach().float().mean() / self._weight if self.has_last else torch.zeros(())
        )
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= dist.get_world_size(self.dp_group)
        return loss.item()

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of each tied parameter's copies over the pipeline (ranks without a copy add
        zeros), so that every copy takes the same update."""
        device = self.stages[0].device
        for tied in self.tied:
            param = tied.param
            grad = param.grad if param is not None else None
            if grad is None:
                grad = torch.zeros(tied.shape, dtype=tied.dtype, device=device)
            dist.all_reduce(_local(grad), group=self.group)
            if param is not None:
                param.grad = grad

    def sync_gradients(self) -> None:
        """Average this rank's gradients over its data-parallel replicas: one all-reduce of all of them
        packed flat (no overlap with backward; a parameter without a gradient counts as zeros). On a stage
        mesh, reduce the DTensor gradients' pending sums instead (`reduce_pending`). With a `grad_sync`
        (optimizer levels 1-2), it reduces them in its buckets (reduce-scattered at level 2)."""
        if self.grad_sync is not None:
            self.grad_sync.reduce_now()
            return
        if self.mesh is not None:
            reduce_pending(self.parameters(), self.mesh)
            return
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        params = self.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(piece.view_as(p.grad))

    def stage_ranks(self) -> int:
        """How many ranks run this pipeline rank's stages together (its stage mesh, or its dp replicas)."""
        if self.mesh is not None:
            return self.mesh.world_size
        return dist.get_world_size(self.dp_group) if self.dp_group is not None else 1

    def peak_activation_bytes(self) -> list[int]:
        """Peak bytes of saved activations of each of this rank's stages since the last reset."""
        return [s.activations.peak for s in self.stages]

    def reset_peaks(self) -> None:
        for s in self.stages:
            s.activations.reset_peak()


def reduce_pending(params: Sequence[nn.Parameter], mesh: Mesh) -> None:
    """Reduce the pending sums (Partial placements) of DTensor gradients on `mesh`: gradients that wait on
    the same mesh dims are packed into one flat buffer and all-reduced together (loom.parallelize's routes,
    without its bucketing and overlap, since a schedule runs many backward passes per step); whatever
    else differs from a parameter's placements is then redistributed by DTensor."""
    route = dtensor_route(mesh)
    groups: dict[tuple, tuple] = {}
    for param in params:
        if param.grad is not None:
            where, _ = route(param)
            if where is not None:
                groups.setdefault(where.key, (where, []))[1].append(param)
    for where, members in groups.values():  # in the same order on every rank: the stage's parameter order
        flat = torch.cat([_local(p.grad).reshape(-1) for p in members])
        dist.all_reduce(flat, group=where.group)
        if where.scale != 1:
            flat *= where.scale
        for param, piece in zip(members, flat.split([_local(p.grad).numel() for p in members]), strict=True):
            where.finish(param, piece)
    fix_placements(list(params))()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (a plain tensor as it is)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
