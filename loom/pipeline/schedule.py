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
averaged over the micro-batches, broadcast to every rank of the pipeline and averaged over the data-parallel
replicas, so `step` returns the global loss on every rank; gradients are those of that mean.
"""

from __future__ import annotations

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
    `dp_group` the data-parallel replicas of these stages, whose gradients and losses are averaged.
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
        self.group, self.dp_group, self.microbatches = group, dp_group, microbatches
        self.modules = list(modules)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.last_rank = 0 if kind.placement == "v" else self.pp - 1
        self.schedule = kind.cls(
            self.stages if kind.multi else self.stages[0], n_microbatches=microbatches, loss_fn=loss_fn
        )

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of all its stages)."""
        return [p for m in self.modules for p in m.parameters()]

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """Forward and backward of one batch (split into the micro-batches on dim 0); gradients accumulate
        into `.grad` (averaged over the data-parallel replicas); returns the global mean loss on every rank.
        Only the rank with the first stage reads `inputs`, only the one with the last reads `targets`."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        loss = torch.stack([x.detach() for x in losses]).mean() if self.has_last else torch.zeros(())
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            self._average_over_replicas(loss)
        return loss.item()

    def _average_over_replicas(self, loss: torch.Tensor) -> None:
        size = dist.get_world_size(self.dp_group)
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad /= size
        dist.all_reduce(loss, group=self.dp_group)
        loss /= size

    def peak_activation_bytes(self) -> list[int]:
        """Peak bytes of saved activations of each of this rank's stages since the last reset."""
        return [s.activations.peak for s in self.stages]

    def reset_peaks(self) -> None:
        for s in self.stages:
            s.activations.reset_peak()
