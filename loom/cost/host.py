"""The host's and the device's timelines of a pass that synchronises them: when the CPU, not the GPU, sets
the pace.

In eager PyTorch the host enqueues kernels one after another, each costing it `launch_s` (Python, the
dispatcher, the framework's own code and the driver's launch), and the device runs them in order, each as
soon as it is enqueued and the previous one has ended. Left alone the host runs ahead and its cost hides
behind the device's work. A synchronisation (the host reading a value the device computed: a dropless MoE
layer's per-expert counts, `loom.cost.plan.MOE_SYNCS`) makes the host wait until the device has drained its
queue, so the device then idles until the host has enqueued the next kernel, and runs no faster than the
host enqueues the kernels after it: a segment between two syncs costs about max(its device time, its
kernels x `launch_s`), plus the first launch.

`host_bound_pass` plays one such pass kernel by kernel (the segments' device time spread evenly over their
kernels, as loom prices a layer's work in aggregate); `loom.cost.layer` prices each layer pass of a plan
whose MoE dispatch syncs with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HostPass", "Segment", "host_bound_pass"]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Kernels the host enqueues between two synchronisations: `device_s` seconds of device work in
    `kernels` launches; `sync` says whether the host then waits for the device to finish them."""

    device_s: float
    kernels: int
    sync: bool = True

    def __post_init__(self) -> None:
        if self.device_s < 0 or self.kernels < 1:
            raise ValueError(
                f"Segment: device_s={self.device_s}, kernels={self.kernels}: give device_s >= 0 and kernels >= 1"
            )


@dataclass(frozen=True, kw_only=True)
class HostPass:
    """When a pass ends on the device, and how much of that is the device waiting on the host."""

    end: float  # seconds from the pass's start (host and device both idle) until the device is done
    device: float  # seconds of device work alone
    intervals: tuple[tuple[str, int, float, float], ...]  # ("launch" | "kernel", segment, start, end)

    @property
    def exposed(self) -> float:
        """Seconds the pass takes beyond its device work: the device waiting for launches."""
        return self.end - self.device


def host_bound_pass(segments: Sequence[Segment], launch_s: float) -> HostPass:
    """Play `segments` on the two timelines, host and device starting together (as after a sync): each
    kernel is enqueued `launch_s` after the previous one (or after the sync that ended the host's wait) and
    runs when enqueued and the device is free; after a segment with `sync` the host waits for the device."""
    if launch_s < 0:
        raise ValueError(f"host_bound_pass: launch_s={launch_s} must be >= 0 (seconds per kernel launch)")
    host = device = 0.0
    intervals: list[tuple[str, int, float, float]] = []
    for index, segment in enumerate(segments):
        each = segment.device_s / segment.kernels
        for _ in range(segment.kernels):
            intervals.append(("launch", index, host, host + launch_s))
            host += launch_s
            start = max(host, device)
            device = start + each
            intervals.append(("kernel", index, start, device))
        if segment.sync:
            host = max(host, device)
    work = sum(segment.device_s for segment in segments)
    return HostPass(end=device, device=work, intervals=tuple(intervals))
