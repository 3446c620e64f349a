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
averaged over the micro-batches (each weighted by 1/micro-batches in backward); `run` leaves it there and
`global_loss` makes it the global mean on every rank with one collective (a trainer accumulating several
batches calls it once per step); gradients are those of that mean.

Gradients are reduced by the stages' one `GradSync` (`loom.parallel.pipeline.reduction`), bucket by bucket while
each stage's last backward pass of the step runs, and finished after the schedule. Stages laid out on a
stage mesh (tensor parallelism inside stages; `mesh`) compute on it: their primitives and DTensors carry it,
so no mesh is made current.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
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

from loom.dist.mesh import Mesh
from loom.parallel.grad_sync import GradSync
from loom.parallel.pipeline.balance import carry_balancing_losses
from loom.parallel.pipeline.reduction import stage_grad_sync
from loom.parallel.pipeline.stage import TimedStage
from loom.parallel.pipeline.tied import Tied
from loom.parallel.pipeline.timeline import Recorder
from loom.parallel.zero3 import ParameterSharding
from loom.plan import SCHEDULE_VIRTUAL
from loom.plan import SCHEDULES as PLAN_SCHEDULES


@dataclass(frozen=True, kw_only=True)
class ScheduleKind:
    """How a named schedule runs: torch's class, whether it takes several stages, how stages are placed."""

    cls: type
    multi: bool
    placement: str  # "single", "loop" or "v"
    min_virtual: int = 1
    max_virtual: int | None = None
    split_backward: bool = False  # input- and weight-gradient passes apart (zero-bubble schedules)


def _kind(name: str, **how) -> ScheduleKind:
    """`name`'s ScheduleKind, its range of stages per rank taken from the plan vocabulary."""
    low, high = SCHEDULE_VIRTUAL[name]
    return ScheduleKind(min_virtual=low, max_virtual=high, **how)


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": _kind("gpipe", cls=ScheduleGPipe, multi=False, placement="single"),
    "1f1b": _kind("1f1b", cls=Schedule1F1B, multi=False, placement="single"),
    "interleaved": _kind("interleaved", cls=ScheduleInterleaved1F1B, multi=True, placement="loop"),
    "zero_bubble": _kind(
        "zero_bubble", cls=ScheduleInterleavedZeroBubble, multi=True, placement="loop", split_backward=True
    ),
    "zbv": _kind("zbv", cls=ScheduleZBVZeroBubble, multi=True, placement="v", split_backward=True),
}
assert tuple(SCHEDULES) == PLAN_SCHEDULES, "every schedule of loom.plan.SCHEDULES has a runner here"


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
    `dp_group` the data-parallel replicas of these stages (plain stages: their gradients are averaged over
    it); `stage_group` every rank that runs these stages (replicas x tensor-parallel ranks; needed when
    there is anything to reduce). `tied` lists the parameters whose copies other pipeline ranks hold (see
    `Tied`). `mesh`: the stage mesh (dp x tp ranks of this pipeline rank) when the stages are laid out on
    it; their losses are then shares of the global loss and their gradients' pending sums are reduced.
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
        stage_group: dist.ProcessGroup | None = None,
        recorder: Recorder | None = None,
        tied: Sequence[Tied] = (),
        mesh: Mesh | None = None,
        bucket_mb: float = 25.0,
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
        self.stage_group = stage_group
        self.modules = list(modules)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.kind, self.schedule_name = kind, schedule
        self.loss_fn = loss_fn
        self.tied = list(tied)
        self.grad_sync = self._grad_sync(bucket_mb)
        self.sharding: ParameterSharding | None = None  # optimizer level 3: `shard_parameters`
        self._pinned: list[int] = []  # level 3: units gathered through a whole run
        self._syncing = False  # this step's last backward passes reduce the gradients
        self._working = False  # inside a stage's piece of work (not a schedule's shape inference)
        for position, stage in enumerate(self.stages):
            stage.work = functools.partial(self._work, position)
            if self.grad_sync is not None:
                stage.weight_grads_ready = self._weight_grads_ready
        self._weight = 1.0
        for module in self.modules:  # mixtures of experts: their balancing losses ride on the stage's output
            carry_balancing_losses(module, lambda: self._weight, lambda: self._working)
        # scale_grads=False: the loss is weighted instead (`_weighted_loss`), because torch's scaling divides
        # whatever `.grad` holds, which would also shrink gradients accumulated by earlier `step` calls
        self.schedule = kind.cls(
            self.stages if kind.multi else self.stages[0],
            n_microbatches=microbatches,
            loss_fn=self._weighted_loss,
            scale_grads=False,
        )

    def _grad_sync(self, bucket_mb: float) -> GradSync | None:
        """The stages' `GradSync`, or None where no gradient needs reducing (one rank per stage, no copies)."""
        replicas = self.dp_group is not None and dist.get_world_size(self.dp_group) > 1
        if not (replicas or self.mesh is not None or any(t.param is not None for t in self.tied)):
            return None
        if self.stage_group is None:
            raise ValueError("a pipeline whose gradients need reducing needs its stage_group")
        return stage_grad_sync(
            self.modules, stage_group=self.stage_group, dp_group=self.dp_group, mesh=self.mesh,
            tied=self.tied, bucket_mb=bucket_mb,
        )  # fmt: skip

    @contextlib.contextmanager
    def _work(self, position: int, kind: str, last_backward: bool) -> Iterator[None]:
        """A piece of work of this rank's stage `position`: at level 3 the stage's parameters are gathered
        for it; the step's last backward pass reduces the gradients as they are ready."""
        with contextlib.ExitStack() as stack:
            if self.sharding is not None:
                stack.enter_context(self.sharding.gathering([len(self._pinned) + position]))
            if self.grad_sync is not None:
                stack.enter_context(
                    self.grad_sync.syncing(self._syncing and last_backward and kind != "forward")
                )
            self._working = True
            try:
                yield
            finally:
                self._working = False

    def shard_parameters(self) -> ParameterSharding:
        """Optimizer level 3: this rank's stage parameters sharded at rest over the ranks that run them (the
        buckets of the stages' `GradSync`, cut by `ZeroOptimizer`), each stage gathered around each of its
        pieces of work in the schedule (forward, backward, weight-gradient) and freed after it. Parameters
        that several stages use (a tied embedding, whose copies other pipeline ranks hold: gathering them
        is a collective with those ranks) stay gathered through each `run` instead, so that no collective
        outside the stage's ranks runs inside the schedule."""
        if self.grad_sync is None:
            raise ValueError("parameters are sharded over the ranks that run a stage; this one has no others")
        several = {id(p) for p in self.grad_sync.final_passes}  # used by several of this rank's stages
        tied = {id(t.param) for t in self.tied if t.param is not None}
        shared = [p for p in self.parameters() if id(p) in several or id(p) in tied]
        units = ([nn.ParameterList(shared)] if shared else []) + list(self.modules)
        self._pinned = [0] if shared else []
        sharding = ParameterSharding(nn.ModuleList(self.modules), self.grad_sync, units, hooks=False)
        for position, module in enumerate(self.modules):
            # torch's schedules also run a stage's forward (and input backward) outside its pieces of work,
            # to infer shapes when they (re)initialise the stages (first step, switching between training
            # and evaluation): the stage is gathered then, and freed by its next piece of work
            unit = len(self._pinned) + position
            module.register_forward_pre_hook(lambda *_, unit=unit: sharding.gather(unit))
        self.sharding = sharding
        return sharding

    def _weight_grads_ready(self, params: list[nn.Parameter]) -> None:
        assert self.grad_sync is not None
        for param in params:
            self.grad_sync.grad_ready(param)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of all its stages; one that two of them share, once)."""
        return list(dict.fromkeys(p for m in self.modules for p in m.parameters()))

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter of this rank's stages whole in memory inside the block (at optimizer level 3 they
        are sharded at rest)."""
        if self.sharding is None:
            yield
            return
        with self.sharding.full_parameters():
            yield

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
        loss on every rank (`run`, then `global_loss`). Only the rank with the first stage reads `inputs`,
        only the one with the last reads `targets`."""
        return self.global_loss([self.run(inputs, targets, weight=weight, sync=sync)])

    def run(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        weight: float = 1.0,
        sync: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of one batch; returns this rank's loss (the mean over the micro-batches on
        the rank with the last stage, zero elsewhere: see `global_loss`).

        Gradients of `weight` times the mean loss accumulate into `.grad` (a trainer accumulating several
        batches passes 1/batches, times its loss scale); with `sync` (the last batch of a step) they are
        reduced (averaged over the data-parallel replicas, tied copies summed) during each stage's last
        backward pass and finished before `run` returns.
        """
        self._weight = weight / self.microbatches
        self._syncing = sync
        with self._pinned_units():
            try:
                loss = self._run(self.schedule.step, inputs, targets)
            finally:
                self._syncing = False
            if sync and self.grad_sync is not None:
                self.grad_sync.finish()
        return loss

    def _pinned_units(self):
        """Level 3: the units gathered through a whole run (shared parameters; see `shard_parameters`)."""
        if self.sharding is None:
            return contextlib.nullcontext()
        return self.sharding.gathering(self._pinned)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """The global mean loss of one batch, forward only (the same schedule without its backward)."""
        return self.global_loss([self.run_eval(inputs, targets)])

    @torch.no_grad()
    def run_eval(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """This rank's loss of one batch, forward only (see `run` and `global_loss`)."""
        if self.kind.placement == "v":
            raise NotImplementedError(
                "evaluating a zbv pipeline is not supported: torch's ScheduleZBVZeroBubble has no "
                "forward-only path (its eval fails in torch 2.13); evaluate with another schedule"
            )
        self._weight = 1.0
        with self._pinned_units():
            return self._run(self.schedule.eval, inputs, targets)

    def _run(self, call: Callable, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        # contiguous: torch 2.11's first stage refuses inputs whose strides differ from its example's (a
        # batch sliced from a longer one, `ids[:, :-1]`); 2.13 compares shapes alone
        args = (inputs.contiguous(),) if self.has_first else ()
        # stages laid out on a stage mesh compute on it: their primitives are bound to it (no current mesh)
        call(*args, **({"target": targets, "losses": losses} if self.has_last else {}))
        if not self.has_last:
            return torch.zeros(())
        # the schedule keeps the weighted losses: unweight their mean (fp32, as the other ranks receive it)
        return torch.stack(losses).detach().float().mean() / self._weight

    def global_loss(self, losses: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> float:
        """The global mean of `run`'s losses (one per batch of a step), on every rank: one all-reduce over
        `group` (default: the world), every rank of which runs one pipeline rank. The ranks with the last
        stage hold shares whose mean over the ranks that run it is the global loss (plain stages: each
        replica's mean over its rows; tensor-parallel stages: `tensor_stages.local_share`); the others zeros."""
        loss = torch.stack(list(losses)).mean()
        dist.all_reduce(loss, group=group)
        return (loss * self.pp / dist.get_world_size(group)).item()

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
