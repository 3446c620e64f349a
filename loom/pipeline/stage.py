"""`TimedStage`: torch's `PipelineStage` that records its work (timeline events) and its saved activations.

torch's schedules call the stage's public per-chunk methods (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`, `get_*_ops`); overriding them is enough to see every piece of work without
touching the schedules.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from loom.pipeline.memory import SavedActivations
from loom.pipeline.timeline import Recorder


class TimedStage(PipelineStage):
    """A pipeline stage whose forward, backward, weight-gradient, send and receive work is recorded in
    `recorder` (when given) and whose saved activations are counted in `activations`."""

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

    def _span(self, kind: str, chunk: int):
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.span(kind, self.stage_index, chunk)

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
        with self._span("backward", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self._span("weight", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
