"""Saving in the background (`Checkpointer(async_save=True)`): `start_save` copies the state of the step to
the CPU and writes the small side files, then the checkpoint thread (worker.py) does the rest while training
goes on: DCP's write of the copy over a gloo group of its own (each rank its own pieces, hashed as written),
the write hooks, the one agreement (every rank's error and files, on that group), and on rank 0 the
manifest, the rename and pruning. So training issues no collective while a save is pending, and the
checkpoint appears as soon as every rank's write has succeeded.

Every rank learns the same outcome from the agreement; `PendingSave.finish` returns it (the published
directory, or the `CheckpointError` of any rank's failure, raised on every rank), so a caller that finishes
at the same step on every rank (the next save, the end of training) stays in step. Training that stops
with an exception stops its write (`PendingSave.stop`): nothing is published, earlier checkpoints are
untouched.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.checkpoint import checkpointer as ck
from loom.checkpoint import state as st
from loom.checkpoint import worker
from loom.checkpoint.chunks import Pieces
from loom.checkpoint.state import Trainable as Trainer
from loom.dist import env
from loom.dist._torch_private import dtensor_like

# The gloo group of background writes, with the default group it was made from (see _checkpoint_group).
_io_group: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


@dataclass
class PendingSave:
    """A checkpoint being written in the background (`start_save`'s); every rank holds one. Nothing here is
    collective: the agreement happens in the background."""

    step: int
    final: Path
    outcome: Future  # the published directory, or the CheckpointError every rank raises
    stopper: threading.Event = field(default_factory=threading.Event)

    def done(self) -> bool:
        """Whether this rank knows the outcome (locally; the other ranks learn the same one)."""
        return self.outcome.done()

    def succeeded(self) -> bool:
        """Whether the checkpoint was published (False while pending)."""
        return self.outcome.done() and self.outcome.exception() is None

    def finish(self) -> Path:
        """Wait for the outcome: the published checkpoint, or the `CheckpointError` that every rank raises."""
        return self.outcome.result()

    def stop(self) -> None:
        """Stop the write: its next block raises, so the checkpoint is not published (the agreement still
        runs, in the background, for the ranks that go on)."""
        self.stopper.set()


def start_save(
    root: str | Path, trainer: Trainer, *, data: Any = None, config: Any = None, keep_last: int | None = None
) -> PendingSave:
    """Begin saving the trainer as `save_checkpoint` does, with DCP's files written in the background;
    collective. Returns once the state of this step is copied: training may go on and update parameters and
    optimizer states in place meanwhile. A failure before the background write starts raises
    `CheckpointError` on every rank at once."""
    step = trainer.step
    temp, final = ck.prepare(Path(root), step)
    error, staged, info, files = None, None, {}, {}  # staged and info are set whenever error stays None
    try:
        staged = _staged_state(trainer)
        plan = ck.plan_of(trainer, config)
        info = ck.manifest_info(step, plan)
        files = ck.write_side_files(temp, trainer, data, plan)
    except ck.SAVE_ERRORS as exc:
        error = ck.describe(exc)
    # Agreed before any background collective starts: a rank that did not launch its write would leave
    # the others' writes waiting on the checkpoint group for ever.
    error, _ = ck.agree(error, {})
    if error is not None:
        raise ck.failure(step, final, error)
    group = _checkpoint_group()
    pending = PendingSave(step, final, Future())
    job = (step, temp, final), staged, files, info, keep_last, group, pending
    worker.submit(_write_and_publish, *job)
    return pending


def _write_and_publish(
    save: tuple[int, Path, Path],
    staged: dict[str, Any],
    files: ck.Files,
    info: dict[str, Any],
    keep_last: int | None,
    group: dist.ProcessGroup | None,
    pending: PendingSave,
) -> None:
    """The checkpoint thread's part: DCP's write, the hooks, the agreement and publishing (collective over
    the checkpoint group), pruning; the outcome goes to `pending` whatever happens."""
    step, temp, final = save
    error = None
    try:
        files = {**files, **ck.write_dcp(staged, temp, group, pending.stopper)}
        ck.run_hooks(step, temp)
    except ck.SAVE_ERRORS as exc:
        error = ck.describe(exc)
    try:
        ck.conclude(save, error, files, info, group)
    except BaseException as exc:  # the CheckpointError of conclude, or a failed collective
        pending.outcome.set_exception(exc)
        return
    pending.outcome.set_result(final)
    ck.prune(final.parent, keep_last)  # published already: a failure to prune is only a warning


def _staged_state(trainer: Trainer) -> dict[str, Any]:
    """A private CPU copy of what DCP saves, taken now: training may then update parameters and optimizer
    states in place while the copy is written (at levels 1-3 this rank's chunks, piece by piece)."""
    with torch.no_grad():
        return _cpu_copy(st.dcp_state(trainer.model, trainer.optimizer), {})


def _cpu_copy(value: Any, memo: dict[int, Any]) -> Any:
    """`value` with every tensor copied to the CPU, through nested dicts, lists, tuples and `Pieces` (an
    object met twice is copied once). Not DCP's `DefaultStager` (torch 2.13): it takes a DTensor whose local
    tensor starts inside its storage for a plain tensor and fails, and knows nothing of `Pieces`."""
    if torch.is_tensor(value) or isinstance(value, Pieces):
        if id(value) not in memo:
            memo[id(value)] = value.map(_tensor_copy) if isinstance(value, Pieces) else _tensor_copy(value)
        return memo[id(value)]
    if isinstance(value, dict):
        return {key: _cpu_copy(item, memo) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(item, memo) for item in value)
    return copy.deepcopy(value)


def _tensor_copy(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        # the same layout over a CPU copy of the local shard (`DTensor.from_local` would move the copy
        # back to the mesh's device)
        return dtensor_like(_tensor_copy(tensor.to_local()), tensor)
    return tensor.detach().to("cpu", copy=True)


def _checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group of background checkpoint writes, made once per default group (collective the first
    time: every rank starts its first background save together). DCP's collectives and the agreement run
    in the checkpoint thread; on a group of their own they never interleave with training's."""
    global _io_group
    if not ck.distributed():
        return None
    world = dist.group.WORLD
    if _io_group is None or _io_group[0] is not world:
        _io_group = (world, dist.new_group(backend="gloo", timeout=env.collective_timeout()))
    return _io_group[1]
