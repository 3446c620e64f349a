"""Recording what sharded operators do: the layouts chosen and the redistributions inserted.

`loom.parallelize` records a dry run on the meta device to learn which parameters feed which operator
inputs; the demo and users record a real run to print the plan (`with loom.ops.record() as events: ...`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from loom.layout.tensor_layout import TensorLayout


@dataclass(kw_only=True)
class InputEvent:
    """One tensor input of one operator call."""

    name: str
    tensor: torch.Tensor
    before: TensorLayout | None  # None: a plain (replicated) tensor
    after: TensorLayout

    @property
    def redistributed(self) -> bool:
        before = self.before or TensorLayout.replicated(self.after.ndim)
        return before != self.after


@dataclass(kw_only=True)
class OpEvent:
    """One operator call: its inputs and its output layout."""

    op: str
    inputs: list[InputEvent]
    output: TensorLayout | None = None


@dataclass
class Recording:
    """The events of a `record()` block, in call order."""

    events: list[OpEvent] = field(default_factory=list)


_active: ContextVar[Recording | None] = ContextVar("loom_op_recording", default=None)


@contextmanager
def record() -> Iterator[Recording]:
    """Record every sharded operator call inside the block."""
    recording = Recording()
    token = _active.set(recording)
    try:
        yield recording
    finally:
        _active.reset(token)


def active_recording() -> Recording | None:
    """The recording of the enclosing `record()` block, or None. Compiled code never records (recording
    is an eager dry run's), and torch.compile cannot trace `ContextVar.get`: it would break every block's
    graph at every operator."""
    if torch.compiler.is_compiling():
        return None
    return _active.get()
