"""`Checkpointer`: save every N steps and/or every M minutes, keep the last k, resume from the newest; with
`async_save`, write each checkpoint in the background while training goes on."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint import worker
from loom.checkpoint.background import PendingSave, start_save
from loom.checkpoint.checkpointer import load_checkpoint, save_checkpoint
from loom.checkpoint.manifest import CheckpointError, CheckpointWarning
from loom.checkpoint.state import Trainable as Trainer
from loom.dist import env


class Checkpointer:
    """Saves a trainer under `directory` when `every_steps` steps or `every_minutes` minutes have passed
    (0: never by that criterion), keeping the newest `keep_last`. `data` (a `DistributedBatches`) and
    `config` (saved as JSON) are optional. Also usable as a Trainer callback (`on_step_end`, `on_train_end`).

    With `async_save`, a due save copies the state of its step and returns; the files are written in the
    background while training continues, and the checkpoint is published (manifest, rename) in the
    background as soon as every rank's write has finished, with no collective in the training thread
    while it is pending (see background.py). A step end notes a published save (`poll`, local); `wait`
    (before the next save starts, and at the end of training) waits for the outcome, and is where a failed
    background save is reported, at the same step on every rank. A loop that calls `maybe_save` itself
    calls `wait` at the end. `last_blocking_s` is how long the newest finished save held training up (all
    of a synchronous save; for a background one its copy and the wait for its outcome).

    `on_save_error` says what a failed save (disk full, permissions; reported on every rank) does: "stop"
    raises the `CheckpointError`, "continue" warns and trains on. Either way earlier checkpoints are
    intact. Old checkpoints are pruned off the training thread."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        keep_last: int = 3,
        data: Any = None,
        config: Any = None,
        async_save: bool = False,
        on_save_error: str = "stop",
    ) -> None:
        if on_save_error not in ("stop", "continue"):
            raise ValueError(f"on_save_error {on_save_error!r}; choose 'stop' or 'continue'")
        if every_steps < 0 or every_minutes < 0 or keep_last < 1:
            raise ValueError(
                f"every_steps {every_steps} and every_minutes {every_minutes} must be >= 0, "
                f"keep_last {keep_last} >= 1"
            )
        self.directory, self.every_steps, self.every_minutes = Path(directory), every_steps, every_minutes
        self.keep_last, self.data, self.config, self.async_save = keep_last, data, config, async_save
        self.on_save_error = on_save_error
        self._last_save = time.monotonic()
        self.last_saved_step: int | None = None  # the step of the newest checkpoint published or resumed from
        self._pending: PendingSave | None = None
        self._blocked = 0.0  # seconds the save in progress has held training up so far
        self.last_blocking_s: float | None = None  # the same for the newest finished (or failed) save
        self.total_blocking_s = 0.0
        self._due_at: tuple[int, bool] | None = None  # the step last asked about by the clock, and the answer

    @classmethod
    def from_config(cls, config: Any, data: Any = None) -> Checkpointer:
        """From a `TrainConfig` (its `[checkpoint]` section; the whole config is saved with each checkpoint)."""
        section = config.checkpoint
        if section.dir is None:
            raise ValueError("checkpoint.dir is not set; set it to where checkpoints go")
        return cls(
            section.dir, every_steps=section.every_steps, every_minutes=section.every_minutes,
            keep_last=section.keep_last, data=data, config=config, async_save=section.async_save,
            on_save_error=section.on_save_error,
        )  # fmt: skip

    @property
    def pending_step(self) -> int | None:
        """The step of the background save in progress (None: none)."""
        return self._pending.step if self._pending is not None else None

    def due(self, step: int) -> bool:
        """Whether to save after `step` (the same answer on every rank: rank 0's clock decides). Asked again
        for the same step (a callback that reads the device before a save, `NonFiniteGuard`), it gives the
        same answer without asking the clock again."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_minutes:
            return False
        if self._due_at is not None and self._due_at[0] == step:
            return self._due_at[1]
        self._due_at = (step, self._late())
        return self._due_at[1]

    def _late(self) -> bool:
        """Whether `every_minutes` have passed since the last save, by rank 0's clock (collective)."""
        late = time.monotonic() - self._last_save >= 60 * self.every_minutes
        flag = torch.tensor([float(late)], device=env.device_type())  # NCCL broadcasts device tensors only
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def save(self, trainer: Trainer) -> Path:
        """Save now and return once the checkpoint is published (collective); a pending background save is
        finished first. How `loom train` saves the final state."""
        self.wait()
        try:
            with self._blocking():
                path = save_checkpoint(
                    self.directory, trainer, data=self.data, config=self.config, keep_last=self.keep_last
                )
        finally:
            self._concluded()
        self._last_save = time.monotonic()
        self.last_saved_step = trainer.step
        return path

    def start(self, trainer: Trainer) -> Path:
        """Begin a background save of this step (collective; a pending one is finished first). Returns the
        directory the checkpoint will have once published."""
        self.wait()
        try:
            with self._blocking():
                self._pending = start_save(
                    self.directory, trainer, data=self.data, config=self.config, keep_last=self.keep_last
                )
        except BaseException:
            self._concluded()
            raise
        self._last_save = time.monotonic()
        return self._pending.final

    def poll(self) -> Path | None:
        """The pending background save's checkpoint if it has been published (None: still pending, none
        pending, or failed: a failure is raised by `wait`, where every rank reports it at the same step).
        Local: no collective."""
        if self._pending is None or not self._pending.succeeded():
            return None
        return self._finish()

    def wait(self) -> Path | None:
        """Wait for the pending background save's outcome, if any (every rank gets the same one): the
        published checkpoint, or its `CheckpointError`; None when none was pending. Pruning old checkpoints,
        which runs in the background, has ended too."""
        try:
            return self._finish() if self._pending is not None else None
        finally:
            worker.settle()

    def maybe_save(self, trainer: Trainer) -> Path | None:
        """Note a published background save (`poll`), then save if `due(trainer.step)`: in the background
        with `async_save` (returning where the checkpoint will appear), else at once."""
        self.poll()
        if not self.due(trainer.step):
            return None
        return self.start(trainer) if self.async_save else self.save(trainer)

    def resume(self, trainer: Trainer) -> int | None:
        """Load the newest intact checkpoint (None: none yet, start from scratch)."""
        step = load_checkpoint(self.directory, trainer, data=self.data)
        self._last_save = time.monotonic()
        self.last_saved_step = step
        if step is not None and env.rank() == 0:
            print(f"resumed from {self.directory}/step_{step:06d}", flush=True)
        return step

    def on_step_end(self, trainer: Trainer, result: object) -> None:
        """Trainer callback: note a published background save; save when due (a failure stops training
        or is reported and skipped, as `on_save_error` says)."""
        self.tolerant(self.maybe_save, trainer)

    def tolerant(self, save: Callable[[Trainer], Path | None], trainer: Trainer) -> Path | None:
        """`save(trainer)`, whose `CheckpointError` (raised on every rank alike) is re-raised with
        `on_save_error = "stop"` and becomes a warning with "continue"."""
        try:
            return save(trainer)
        except CheckpointError as error:
            if self.on_save_error == "stop":
                raise
            if env.rank() == 0:
                warnings.warn(
                    f"{error}; training continues (on_save_error = 'continue')", CheckpointWarning, 2
                )
            return None

    def on_train_end(self, trainer: Trainer) -> None:
        """Trainer callback: finish a pending background save (never starts one).

        Training that ends with an exception may have stopped on this rank alone, with its peers inside
        some other collective: then the pending save's write is stopped and it is not published (its
        temporary directory is never loaded, and is removed by a later save)."""
        if sys.exc_info()[1] is not None:
            self._abandon()
            return
        self.tolerant(lambda _: self.wait(), trainer)  # a failed last save: as `on_save_error` says

    def _finish(self) -> Path:
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            with self._blocking():
                path = pending.finish()
        finally:
            self._concluded()
        self.last_saved_step = pending.step
        return path

    def _abandon(self) -> None:
        if self._pending is None:
            return
        self._pending.stop()
        warnings.warn(
            f"training stopped while the checkpoint of step {self._pending.step} was being written: it is "
            "not published",
            CheckpointWarning,
            stacklevel=3,
        )
        self._pending = None
        self._blocked = 0.0

    @contextmanager
    def _blocking(self) -> Iterator[None]:
        """Counts the time inside towards the save in progress (time training is held up)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._blocked += time.perf_counter() - start

    def _concluded(self) -> None:
        """A save finished (or failed): its blocking time becomes `last_blocking_s`."""
        self.last_blocking_s, self._blocked = self._blocked, 0.0
        self.total_blocking_s += self.last_blocking_s
