"""`Checkpointer`: save every N steps and/or every M minutes, keep the last k, resume from the newest."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint.checkpointer import load_checkpoint, save_checkpoint
from loom.checkpoint.state import Trainable as Trainer
from loom.dist import env


class Checkpointer:
    """Saves a trainer under `directory` when `every_steps` steps or `every_minutes` minutes have passed
    (0: never by that criterion), keeping the newest `keep_last`. `data` (a `DistributedBatches`) and
    `config` (saved as JSON) are optional. Also usable as a Trainer callback (`on_step_end`)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        keep_last: int = 3,
        data: Any = None,
        config: Any = None,
    ) -> None:
        if every_steps < 0 or every_minutes < 0 or keep_last < 1:
            raise ValueError(
                f"every_steps {every_steps} and every_minutes {every_minutes} must be >= 0, "
                f"keep_last {keep_last} >= 1"
            )
        self.directory, self.every_steps, self.every_minutes = Path(directory), every_steps, every_minutes
        self.keep_last, self.data, self.config = keep_last, data, config
        self._last_save = time.monotonic()
        self.last_saved_step: int | None = None  # the step of the newest checkpoint saved or resumed from

    @classmethod
    def from_config(cls, config: Any, data: Any = None) -> Checkpointer:
        """From a `TrainConfig` (its `[checkpoint]` section; the whole config is saved with each checkpoint)."""
        section = config.checkpoint
        if section.dir is None:
            raise ValueError("checkpoint.dir is not set; set it to where checkpoints go")
        if section.async_save:
            warnings.warn("checkpoint.async_save is not supported yet: saving synchronously", stacklevel=2)
        return cls(
            section.dir, every_steps=section.every_steps, every_minutes=section.every_minutes,
            keep_last=section.keep_last, data=data, config=config,
        )  # fmt: skip

    def due(self, step: int) -> bool:
        """Whether to save after `step` (the same answer on every rank: rank 0's clock decides)."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_minutes:
            return False
        late = torch.tensor([float(time.monotonic() - self._last_save >= 60 * self.every_minutes)])
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(late, src=0)
        return bool(late.item())

    def save(self, trainer: Trainer) -> Path:
        """Save now (collective)."""
        path = save_checkpoint(
            self.directory, trainer, data=self.data, config=self.config, keep_last=self.keep_last
        )
        self._last_save = time.monotonic()
        self.last_saved_step = trainer.step
        return path

    def maybe_save(self, trainer: Trainer) -> Path | None:
        """Save if `due(trainer.step)`."""
        return self.save(trainer) if self.due(trainer.step) else None

    def resume(self, trainer: Trainer) -> int | None:
        """Load the newest intact checkpoint (None: none yet, start from scratch)."""
        step = load_checkpoint(self.directory, trainer, data=self.data)
        self._last_save = time.monotonic()
        self.last_saved_step = step
        if step is not None and env.rank() == 0:
            print(f"resumed from {self.directory}/step_{step:06d}", flush=True)
        return step

    def on_step_end(self, trainer: Trainer, result: object) -> None:
        """Trainer callback: save when due."""
        self.maybe_save(trainer)
