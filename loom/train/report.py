"""What `loom train` prints: the plan grouped by layout pattern, one copy of each warning per job, a line per
checkpoint saved, and a final summary that reads right for any number of steps.

Everything here is console output only; none of it changes what is trained or saved.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loom.checkpoint import Checkpointer
from loom.dist import env

__all__ = ["ReportedCheckpointer", "group_layouts", "main_rank_warnings", "steps_summary"]

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def group_layouts(rows: Sequence[tuple[str, tuple, str, tuple]], *, verbose: bool = False) -> list[str]:
    """Lines describing parameters `(name, global shape, layout, local shape)`: with `verbose`, one per
    parameter; otherwise one per distinct (global shape, layout, local shape), with how many parameters
    share it and their names with block indices folded (`blocks.*.mlp.fc.weight`), so that a model of
    any depth prints a screenful."""
    if verbose:
        return [f"  {n:32s} {s!s:14s} {lay:26s} local {loc}" for n, s, lay, loc in rows]
    groups: dict[tuple, list[str]] = {}
    for name, shape, layout, local in rows:
        groups.setdefault((tuple(shape), layout, tuple(local)), []).append(name)
    lines = []
    for (shape, layout, local), names in groups.items():
        patterns = list(dict.fromkeys(_INDEX.sub(".*", name) for name in names))
        shown = ", ".join(patterns[:3]) + (f", ... ({len(patterns) - 3} more)" if len(patterns) > 3 else "")
        lines.append(f"  {len(names):4d} x {shape!s:14s} {layout:26s} local {local!s:14s} {shown}")
    return lines


def steps_summary(losses: Sequence[float], first_step: int = 1) -> str:
    """The losses of the steps run (`first_step` is the number of the first), as one line: each step's loss
    up to 4 steps, the first and last step under 20, and means of the first and last 10 from 20 on."""
    n = len(losses)
    if n == 0:
        return "no steps run (train.steps was already reached; raise it to train on)"
    last = first_step + n - 1
    where = f"step {first_step}" if n == 1 else f"steps {first_step}-{last}"
    if n <= 4:
        text = f"{n} step{'s' * (n > 1)} ({where}): loss " + " -> ".join(f"{x:.3f}" for x in losses)
    elif n < 20:
        text = f"{n} steps: loss {losses[0]:.3f} (step {first_step}) -> {losses[-1]:.3f} (step {last})"
    else:
        head, tail = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        text = (
            f"{n} steps: loss {head:.3f} (mean of steps {first_step}-{first_step + 9}) -> {tail:.3f} "
            f"(mean of steps {last - 9}-{last})"
        )
    return text + ("" if all(math.isfinite(x) for x in losses[-10:]) else " (not finite!)")


@contextmanager
def main_rank_warnings(is_main: bool) -> Iterator[None]:
    """Inside: on ranks other than the main one, Python warnings and torch's logged warnings (such as
    DTensor's "CPU process group does not support alltoall" on every rank) are silenced, so that a job
    shows each warning once, from rank 0; errors still show everywhere."""
    if is_main:
        yield
        return
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            torch_logger.setLevel(level)


def _size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:  # pruned meanwhile
                pass
    return total


def describe_save(path: Path, seconds: float, how: str = "") -> str:
    """One line for a published checkpoint: its step, where, its size and how long it took."""
    step = path.name.removeprefix("step_").lstrip("0") or "0"
    size = _size(path)
    return f"checkpoint step {step} saved{how}: {path} ({size / 1e6:.1f} MB, {seconds:.2f} s)"


class ReportedCheckpointer(Checkpointer):
    """A `Checkpointer` that prints a line on rank 0 each time a checkpoint is published (step, path, size,
    seconds), from the paths its save methods return. A background save (`async_save`) counts from its start
    to its publication, most of which overlapped training."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._started: dict[Path, float] = {}

    def save(self, trainer: Any) -> Path:
        start = time.perf_counter()
        path = super().save(trainer)
        self._report(path, time.perf_counter() - start, "")
        return path

    def start(self, trainer: Any) -> Path:
        start = time.perf_counter()
        path = super().start(trainer)
        self._started[path] = start
        return path

    def poll(self) -> Path | None:
        return self._published(super().poll())

    def wait(self) -> Path | None:
        return self._published(super().wait())

    def _published(self, path: Path | None) -> Path | None:
        if path is not None and path in self._started:
            self._report(path, time.perf_counter() - self._started.pop(path), " in the background")
        return path

    def _report(self, path: Path, seconds: float, how: str) -> None:
        if env.rank() == 0:
            print(describe_save(Path(path), seconds, how), flush=True)
