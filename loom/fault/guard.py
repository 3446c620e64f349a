"""The non-finite guard: after N skipped steps in a row, roll back to the last checkpoint.

The Trainer already skips a step whose loss or gradient norm is not finite (in fp16 through the loss
scaler). One such step is noise; several in a row mean the weights or the data went bad. Then
`NonFiniteGuard` writes `rollback.json` into the checkpoint directory (the checkpoint to go back to, and the
data position to continue from, which is past the batches that failed) and raises `NonFiniteRollback`. The
supervisor (`loom.fault.supervise`) restarts the job; the job resumes from that checkpoint and, through
`apply_rollback`, skips the data that produced the non-finite steps. Restarting rather than reloading in
place gives every optimizer level the same, tested resume path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint.manifest import latest_valid, write_atomic
from loom.dist import env

__all__ = ["NonFiniteGuard", "NonFiniteRollback", "apply_rollback"]

ROLLBACK_FILE = "rollback.json"


class NonFiniteRollback(RuntimeError):
    """Raised on every rank when the guard rolls back; a supervised job restarts from the checkpoint."""


class NonFiniteGuard:
    """A Trainer callback: after `rollback_after` skipped steps in a row, ask for a rollback to the last
    checkpoint under `checkpoint_dir`, continuing `data` (a loader with `state_dict`) where it was after
    the step that completed the streak.

    The streak is counted on the device (a step's skip flag is a device tensor until its metrics are read),
    and read where the run reads the device anyway: at the steps `reads_at(step)` says (a logged step, one
    before a checkpoint save: the guard runs before the checkpointer, so a failing streak is never saved);
    by default at every step. The decision is the same as reading every step: the first step at which
    the streak reached `rollback_after` and the data position after it are kept until the read, which rolls
    back to them."""

    def __init__(
        self,
        rollback_after: int,
        checkpoint_dir: str | Path,
        data: Any = None,
        reads_at: Callable[[int], bool] | None = None,
    ) -> None:
        if rollback_after < 1:
            raise ValueError(f"rollback_after {rollback_after} must be >= 1")
        self.rollback_after, self.checkpoint_dir, self.data = rollback_after, Path(checkpoint_dir), data
        self.reads_at = reads_at
        self.streak = 0  # as of the last read
        self._counts: torch.Tensor | None = None  # on the device: [streak, first step it reached the limit]
        self._positions: dict[int, Any] = {}  # the data position after each step since the last read

    def on_step_end(self, trainer: Any, metrics: Any) -> None:
        """Count skipped steps (the same on every rank: the decision to skip is global); read the count at
        the steps `reads_at` names."""
        flag = metrics.skipped_flag()
        counts = self._counts
        if counts is None:  # filled on the device: a tensor copied from the host would wait for it
            counts = torch.full((2,), self.streak, dtype=torch.int64, device=flag.device)
            counts[1].zero_()
        streak = (counts[0] + 1) * flag.to(counts.device, torch.int64)
        reached = (counts[1] == 0) & (streak >= self.rollback_after)
        self._counts = torch.stack([streak, torch.where(reached, trainer.step, counts[1])])
        self._positions[trainer.step] = self.data.state_dict() if self.data is not None else None
        if self.reads_at is None or self.reads_at(trainer.step):
            self._read()

    def _read(self) -> None:
        """Read the device's count (one synchronisation) and roll back if a streak reached the limit."""
        streak, failed_at = self._counts.tolist()
        self._counts = None
        positions, self._positions = self._positions, {}
        if failed_at:
            self.streak = self.rollback_after
            self._roll_back(failed_at, positions[failed_at])
        self.streak = streak

    def _roll_back(self, step: int, position: Any) -> None:
        """Write the marker (the checkpoint to go back to; `position`: the data's after `step`) and raise."""
        target = None
        if env.rank() == 0:
            target = latest_valid(self.checkpoint_dir).step
            marker = {"checkpoint_step": target, "failed_at_step": step, "data": position}  # plain numbers
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.checkpoint_dir / ROLLBACK_FILE, json.dumps(marker).encode())
        if dist.is_initialized():
            dist.barrier()  # the marker is on disk before any rank stops
        origin = "the start" if target is None else f"step {target}"
        raise NonFiniteRollback(
            f"{self.streak} steps in a row ({step - self.streak + 1}..{step}) had a non-finite loss or "
            f"gradient norm; rolling back to {origin} and skipping their data"
        )


def apply_rollback(checkpoint_dir: str | Path, resumed_step: int | None, data: Any) -> bool:
    """After a resume: when a rollback to exactly this checkpoint is pending, move `data` past the batches
    that failed. True when it did. (A later checkpoint supersedes the marker, which then does nothing.)"""
    path = Path(checkpoint_dir) / ROLLBACK_FILE
    if data is None or not path.is_file():
        return False
    marker = json.loads(path.read_text())
    if marker["checkpoint_step"] != resumed_step or marker["data"] is None:
        return False
    data.load_state_dict(marker["data"])
    return True
