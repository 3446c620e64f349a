"""`TimedStage`: torch's `PipelineStage` that records its work (timeline events) and its saved activations,
and runs each piece of work inside a context its pipeline gives (level 3 gathers the stage's parameters
there; the last backward pass of a step reduces its gradients there).

torch's schedules call the stage's public per-chunk methods (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`, `get_*_ops`); overriding them is enough to see every piece of work without
touching the schedules. A zero-bubble schedule's weight-gradient pass writes `.grad` itself (no autograd
accumulation hook fires), so the stage runs it one parameter group at a time, in backward order, and reports
each group's parameters as ready (`weight_grads_ready`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from loom.parallel.pipeline.memory import SavedActivations
from loom.parallel.pipeline.timeline import Recorder

Work = Callable[[str, bool], AbstractContextManager]
"""`work(kind, last_backward)`: the context a stage's piece of work runs in (kind "forward", "backward" or
"weight"; `last_backward`: the stage's last backward pass of the schedule's step)."""


class TimedStage(PipelineStage):
    """A pipeline stage whose forward, backward, weight-gradient, send and receive work is recorded in
    `recorder` (when given) and whose saved activations are counted in `activations`. Each piece of work runs
    inside `work(kind, last_backward)` when set; `weight_grads_ready(params)`, when set, is told of the
    parameters whose gradients a weight-gradient pass has just written."""

    work: Work | None = None
    weight_grads_ready: Callable[[list[nn.Parameter]], None] | None = None

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        group: dist.ProcessGroup | None = None,
        recorder: Recorder | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(module, stage_index, num_stages, device or torch.device("cpu"), group=group)
        self.recorder = recorder
        # parameters are not activations (a DTensor parameter: its local shard is what autograd saves)
        self.activations = SavedActivations(
            p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()
        )
        self._posted: dict[tuple[str, int], float] = {}

    def _note_post(self, direction: str, chunk: int, ops: list) -> list:
        if ops and self.recorder is not None:
            self._posted[(direction, chunk)] = time.perf_counter()
        return ops

    def _close_recv(self, direction: str, chunk: int) -> None:
        start = self._posted.pop((direction, chunk), None)
        if start is not None and self.recorder is not None:
            self.recorder.add("recv", self.stage_index, chunk, start, time.perf_counter())

    def _note_send(self, chunk: int, ops: list) -> list:
        if ops and self.recorder is not None:
            self.recorder.add("send", self.stage_index, chunk, time.perf_counter())
        return ops

    @contextlib.contextmanager
    def _span(self, kind: str, chunk: int, last_backward: bool = False):
        with contextlib.ExitStack() as stack:
            if self.work is not None:
                stack.enter_context(self.work(kind, last_backward))
            if self.recorder is not None:
                stack.enter_context(self.recorder.span(kind, self.stage_index, chunk))
            yield

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._note_post("fwd", fwd_chunk_id, super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._note_post("bwd", bwd_chunk_id, super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._note_send(fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._note_send(bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ):
        self._close_recv("fwd", fwd_chunk_id)
        with self._span("forward", fwd_chunk_id), self.activations.hooks():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
    ):
        self._close_recv("bwd", bwd_chunk_id)
        with self._span("backward", bwd_chunk_id, last_backward):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self._span("weight", bwd_chunk_id, last_backward):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "weight" or self.weight_grads_ready is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # torch's weight pass computes each parameter group's gradients apart (autograd.grad), in any order:
        # one group at a time, the last parameters first (as backward reaches them), each reported when done
        params = list(self.submod.parameters())
        position = {get_gradient_edge(p).node: i for i, p in enumerate(params) if p.requires_grad}
        groups = sorted(
            bwd_kwargs["param_groups"],
            key=lambda group: max((position.get(node, -1) for node in group["params"]), default=-1),
            reverse=True,
        )
        for group in groups:
            super().backward_maybe_with_nosync(
                "weight", {**bwd_kwargs, "param_groups": [group]}, last_backward
            )
            done = sorted((position[node] for node in group["params"] if node in position), reverse=True)
            self.weight_grads_ready([params[i] for i in done])  # in one order on every rank
        return (), None
