"""Play per-device task orders as events: each task starts when its device is free and its input arrived.

Forward of (micro-batch m, virtual stage v) needs the forward of (m, v-1), plus the point-to-point
transfer when they run on different devices; backward of (m, v) needs the backward of (m, v+1). Every
device runs its tasks in its given order. With blocking sends a task that sends its output to another
device holds that device for the transfer too (its next task starts when the send ends); otherwise the
send runs beside the device's next task and only the receiver waits for it. This is a longest-path
computation on the schedule's DAG, done by sweeping the devices until every task is placed: no heap
needed, linear in the number of tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loom.sim.schedule import Task

__all__ = ["Playback", "play"]


@dataclass(kw_only=True)
class Playback:
    """When every task ran: per-device busy time and end, and (optionally) every task's interval."""

    end: list[float]  # per device: when its last task ended
    busy: list[float]  # per device: seconds spent in tasks
    sending: list[float]  # per device: seconds held by blocking sends (0 without them)
    chunk_done: list[list[float]]  # [device][chunk]: when that chunk's last backward ended
    intervals: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        """When the last device finished."""
        return max(self.end)


def play(
    orders: Sequence[Sequence[Task]],
    chunks: int,
    micro_batches: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: float,
    *,
    blocking: bool = False,
    record: bool = False,
) -> Playback:
    """Play `orders` (one per device); `forward_s[v]`, `backward_s[v]` are task durations of virtual stage v,
    `p2p_s` a transfer between devices; `blocking`: a send holds its device until the transfer ends."""
    pp = len(orders)
    stages = pp * chunks
    fwd_done = [[-1.0] * micro_batches for _ in range(stages)]
    bwd_done = [[-1.0] * micro_batches for _ in range(stages)]
    pos, free, busy, sending = [0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp
    chunk_done = [[0.0] * chunks for _ in range(pp)]
    intervals: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for dev in range(pp):
            order, i = orders[dev], pos[dev]
            while i < len(order):
                kind, mb, chunk = order[i]
                stage = chunk * pp + dev
                if kind == "F":
                    ready = 0.0 if stage == 0 else fwd_done[stage - 1][mb]
                    hop = p2p_s if stage > 0 and pp > 1 else 0.0
                    duration = forward_s[stage]
                    sends = stage < stages - 1 and pp > 1  # the output goes on to the next device
                else:
                    ready = fwd_done[stage][mb] if stage == stages - 1 else bwd_done[stage + 1][mb]
                    hop = p2p_s if stage < stages - 1 and pp > 1 else 0.0
                    duration = backward_s[stage]
                    sends = stage > 0 and pp > 1  # the input gradient goes back to the previous device
                if ready < 0:
                    break
                start = max(free[dev], ready + hop)
                end = free[dev] = start + duration
                busy[dev] += duration
                if blocking and sends:
                    free[dev] += p2p_s
                    sending[dev] += p2p_s
                (fwd_done if kind == "F" else bwd_done)[stage][mb] = end
                if kind == "B":
                    chunk_done[dev][chunk] = end
                if record:
                    intervals.append((dev, kind, mb, chunk, start, end))
                i += 1
                remaining -= 1
                progressed = True
            pos[dev] = i
        assert progressed, "pipeline schedule deadlocked: a task waits on one that never runs"
    return Playback(end=free, busy=busy, sending=sending, chunk_done=chunk_done, intervals=intervals)
