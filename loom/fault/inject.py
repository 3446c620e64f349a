"""Faults on purpose: kill, crash, hang or poison one rank at a chosen step, to test recovery end to end.

    faults = [Fault(kind="sigkill", rank=1, step=7)]                  # SIGKILL rank 1 during step 7
    faults = [Fault(kind="sigkill", rank=0, step=4, during="save")]  # ... while it writes step 4's checkpoint
    faults = [Fault(kind="nan", rank=0, step=5, repeat=3)]           # non-finite losses in steps 5-7
    faults = [Fault(kind="hang", rank=1, during="startup", phase="loading the checkpoint")]  # before step 1

A fault fires only in the attempt it names (`attempt`, default 0: the first run, not the restarts), so a
restarted job runs clean; among replicas that come and go (`loom.dist.elastic`) `rank` is the replica's
slot, and a replacement's attempt counts the workers its slot had before it (a replacement runs clean). `loom.train.job.run(config, faults=...)` installs them in every worker: start-up
faults first (they strike when the job announces the phase they name with a heartbeat, see
`loom.train.job.STARTUP_PHASES`), the others once its trainer exists.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from loom.checkpoint import checkpointer
from loom.dist import elastic, env, launch

__all__ = ["Fault", "InjectedFault"]

KINDS = ("sigkill", "exit", "raise", "hang", "nan")
WHEN = ("step", "save", "startup")


class InjectedFault(RuntimeError):
    """The exception a `Fault(kind="raise")` throws."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """What to do (`kind`), on which rank, in which step (1-based, as `Trainer.step` counts after it), for
    how many steps in a row (`repeat`), and when: during the step's forward pass, while the rank writes
    that step's checkpoint (`during="save"`, after its files are written and before the checkpoint is
    published), or before training, as the rank enters start-up phase `phase` (`during="startup"`, no
    step). `seconds` is how long a hang lasts."""

    kind: Literal["sigkill", "exit", "raise", "hang", "nan"]
    rank: int
    step: int | None = None
    during: Literal["step", "save", "startup"] = "step"
    phase: str | None = None
    repeat: int = 1
    attempt: int = 0
    seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r}; choose one of {KINDS}")
        if self.during not in WHEN:
            raise ValueError(f"fault during {self.during!r}; choose one of {WHEN}")
        if self.kind == "nan" and self.during != "step":
            raise ValueError("a 'nan' fault poisons a step's loss: it needs during='step'")
        startup = self.during == "startup"
        if startup != (self.step is None) or startup != bool(self.phase):
            raise ValueError(
                f"{self}: a fault during 'step' or 'save' names its step (and no phase); one during "
                "'startup' names its start-up phase (and no step), e.g. phase='loading the checkpoint'"
            )
        if (self.step is not None and self.step < 1) or self.repeat < 1 or self.rank < 0 or self.attempt < 0:
            raise ValueError(f"{self}: step and repeat must be >= 1, rank and attempt >= 0")

    def install(self, trainer: object | None = None) -> Callable[[], None]:
        """Arm the fault on this rank for `trainer` (a `loom.Trainer`; none for a start-up fault, which is
        armed before the trainer exists); returns a function that disarms it."""
        rank, attempt = env.rank(), env.restart_count()
        if (slot := elastic.membership_slot()) is not None:  # a replica's own process group is of one rank
            rank, attempt = slot[0], attempt + slot[1]
        if rank != self.rank or attempt != self.attempt:
            return lambda: None
        if self.during == "startup":
            launch.BEAT_HOOKS.append(self._on_beat)
            return lambda: launch.BEAT_HOOKS.remove(self._on_beat)
        if trainer is None:
            raise ValueError(f"{self} strikes during a step or a save: install it with the trainer")
        if self.during == "save":
            checkpointer.WRITE_HOOKS.append(self._on_save)
            return lambda: checkpointer.WRITE_HOOKS.remove(self._on_save)
        model: nn.Module = trainer.model
        if self.kind == "nan":
            handle = model.register_forward_hook(lambda module, inputs, output: self._poison(trainer, output))
        else:
            handle = model.register_forward_pre_hook(lambda module, inputs: self._maybe_fire(trainer))
        return handle.remove

    def _due(self, trainer: object) -> bool:
        # a training forward pass (not evaluation) of a step in [step, step + repeat)
        return torch.is_grad_enabled() and self.step <= trainer.step + 1 < self.step + self.repeat

    def _maybe_fire(self, trainer: object) -> None:
        if self._due(trainer):
            self._fire(f"step {trainer.step + 1}")

    def _poison(self, trainer: object, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self._due(trainer) else None

    def _on_beat(self, step: int | None, phase: str | None) -> None:
        if phase == self.phase:
            self._fire(f"start-up phase {phase!r}")

    def _on_save(self, step: int, temp: Path) -> None:
        if step == self.step:
            self._fire(f"writing the checkpoint of step {step} ({temp})")

    def _fire(self, where: str) -> None:
        print(f"loom fault injection: {self.kind} on rank {self.rank} in {where}", flush=True)
        if self.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "exit":
            os._exit(3)
        elif self.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} in {where}")
        elif self.kind == "hang":
            time.sleep(self.seconds)
