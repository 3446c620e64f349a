"""Per-rank pipeline events, the bubble fraction, and a timeline picture.

Times are `time.perf_counter()` seconds: a system-wide monotonic clock on Linux, so events of processes on
one machine share an origin. A receive event runs from posting the receive to the start of the computation
that needed it (its wait included); a send event marks when the send was posted (sends are asynchronous).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

COMPUTE = ("forward", "backward", "weight")
KINDS = (*COMPUTE, "send", "recv")
COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "weight": "#c44e52",
    "send": "#222222",
    "recv": "#bbbbbb",
}


@dataclass(frozen=True, kw_only=True)
class Event:
    """One piece of pipeline work on one rank: `kind` in KINDS, on `stage` for `microbatch`."""

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.end >= self.start, (self.start, self.end)


@dataclass(kw_only=True)
class Recorder:
    """Collects this rank's events."""

    rank: int
    events: list[Event] = field(default_factory=list)

    def add(self, kind: str, stage: int, microbatch: int, start: float, end: float | None = None) -> None:
        """Record an event (an instant one when `end` is None)."""
        end = start if end is None else end
        self.events.append(
            Event(rank=self.rank, kind=kind, stage=stage, microbatch=microbatch, start=start, end=end)
        )

    @contextmanager
    def span(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """Record the time the block takes."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, stage, microbatch, start, time.perf_counter())

    def clear(self) -> None:
        self.events.clear()


def busy_time(events: Sequence[Event]) -> float:
    """Seconds covered by compute events (overlaps counted once)."""
    intervals = sorted((e.start, e.end) for e in events if e.kind in COMPUTE)
    total, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def bubble_fraction(events: Sequence[Event]) -> float:
    """Idle share of one rank's step: time between its first and last event not spent computing, over that
    span (waiting for a receive counts as idle). For the whole step's bubble, see `step_bubbles`."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    return 0.0 if span <= 0 else 1.0 - busy_time(events) / span


def step_bubbles(per_rank: Sequence[Sequence[Event]]) -> list[float]:
    """Each rank's idle share of the whole step, from the first event on any rank to the last on any rank:
    the quantity (p-1)/(m+p-1) describes (`bubble_fraction` spans one rank's own events, which leaves out
    the end of the step after a later rank has finished). The ranks' clocks must agree (`perf_counter` is
    one clock for the processes of a machine)."""
    events = [e for rank in per_rank for e in rank]
    if not events:
        return [0.0 for _ in per_rank]
    span = max(e.end for e in events) - min(e.start for e in events)
    return [0.0 if span <= 0 else 1.0 - busy_time(rank) / span for rank in per_rank]


def theoretical_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The 1F1B / GPipe bubble with equal stages and free communication: (p-1) / (v*m + p-1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def plot_timeline(events: Sequence[Event], path: str, title: str = "pipeline timeline") -> None:
    """Draw one row per rank (compute as bars labelled with the micro-batch, receives as thin grey bars,
    sends as ticks) and save a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.8 * len(ranks) + 1.5))
    for e in events:
        y, start, width = e.rank, (e.start - origin) * 1e3, (e.end - e.start) * 1e3
        if e.kind in COMPUTE:
            ax.barh(y, width, left=start, height=0.6, color=COLORS[e.kind], edgecolor="white", linewidth=0.5)
            ax.text(
                start + width / 2, y, str(e.microbatch), ha="center", va="center", fontsize=6, color="white"
            )
        elif e.kind == "recv":
            ax.barh(y + 0.38, width, left=start, height=0.12, color=COLORS["recv"])
        else:
            ax.plot([start, start], [y - 0.42, y - 0.3], color=COLORS["send"], linewidth=0.8)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in KINDS], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
