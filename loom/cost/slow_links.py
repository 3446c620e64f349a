"""Replicas joined by a slow link: synchronous data parallelism against local SGD / DiLoCo.

A replica is one copy of the model on its own devices (any plan inside: tp, pp); `replicas` of them are
joined by a link of `link.bandwidth` bytes/s per replica (all of a replica's devices share it: their
shards together are the replica's parameters). Synchronising `nbytes` over it is a ring all-reduce of
`2 (R - 1) / R * nbytes / bus_bandwidth + 2 (R - 1) * latency` seconds.

- **Synchronous data parallelism** all-reduces the gradients every step; the all-reduce overlaps the
  backward pass (about two thirds of the step's compute), and only what exceeds it is exposed.
- **DiLoCo / local SGD** all-reduce the parameters (pseudo-gradients) once every `sync_every` steps, in
  `outer_bytes_per_value` bytes a value (4: fp32, 2: bf16). Unstreamed, the replicas wait for it. Streamed
  in `fragments` with a `fragment_delay` of d inner steps, each fragment's all-reduce (1/F of the bytes)
  overlaps the next d inner steps and only its excess is exposed, F times per `sync_every` steps; and the
  fragments share the link, so a step never takes less than the link's busy time per step.

What this leaves out: DiLoCo needs somewhat more tokens than synchronous training to reach the same loss
(measure it: benchmarks/diloco.py); the step time of a replica comes from the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.cost.collectives import bus_factor
from loom.cost.hardware import Link

__all__ = ["SlowLinkComparison", "compare_sync", "ring_all_reduce_s"]

BACKWARD_SHARE = (
    2 / 3
)  # the backward pass's share of a step's compute: what a gradient all-reduce can hide behind


def ring_all_reduce_s(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds to all-reduce `nbytes` among `replicas` over `link` (ring: 2 (R - 1) latency steps)."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    return (
        2 * (replicas - 1) * link.latency_s + nbytes * bus_factor("all_reduce", replicas) / link.bus_bandwidth
    )


@dataclass(frozen=True, kw_only=True)
class SlowLinkComparison:
    """Seconds per step of each way to join the replicas, and the bytes each sends per step on average."""

    replica_step_s: float  # one replica's step alone (no communication between replicas)
    synchronous_step_s: float
    diloco_step_s: float
    synchronous_bytes_per_step: float
    diloco_bytes_per_step: float
    sync_every: int

    @property
    def speedup(self) -> float:
        """How many times faster a DiLoCo step is than a synchronous one (wall-clock)."""
        return self.synchronous_step_s / self.diloco_step_s

    @property
    def byte_reduction(self) -> float:
        """How many times fewer bytes DiLoCo sends per step (1 with a single replica: neither sends)."""
        if self.diloco_bytes_per_step == 0:
            return 1.0
        return self.synchronous_bytes_per_step / self.diloco_bytes_per_step


def compare_sync(
    *,
    replica_step_s: float,
    parameters: int,
    replicas: int,
    link: Link,
    sync_every: int,
    grad_bytes_per_value: int = 4,
    outer_bytes_per_value: int = 4,
    fragments: int = 1,
    fragment_delay: int = 0,
) -> SlowLinkComparison:
    """Synchronous data parallelism against DiLoCo for `replicas` replicas of a `parameters`-parameter
    model whose step alone takes `replica_step_s`, joined by `link` (see the module docstring)."""
    if sync_every < 1 or not 1 <= fragments <= sync_every or not 0 <= fragment_delay < sync_every:
        raise ValueError(
            f"sync_every = {sync_every}, fragments = {fragments}, fragment_delay = {fragment_delay}: need "
            "sync_every >= 1, 1 <= fragments <= sync_every and 0 <= fragment_delay < sync_every"
        )
    grad_bytes = parameters * grad_bytes_per_value
    gradients_s = ring_all_reduce_s(grad_bytes, replicas, link)
    synchronous = replica_step_s + max(0.0, gradients_s - BACKWARD_SHARE * replica_step_s)
    outer_bytes = parameters * outer_bytes_per_value
    fragment_s = ring_all_reduce_s(outer_bytes / fragments, replicas, link)
    exposed = max(0.0, fragment_s - fragment_delay * replica_step_s)  # hidden behind d inner steps
    # the fragments share the link: per step it is busy fragments * fragment_s / sync_every on average
    diloco = max(replica_step_s + fragments * exposed / sync_every, fragments * fragment_s / sync_every)
    return SlowLinkComparison(
        replica_step_s=replica_step_s,
        synchronous_step_s=synchronous,
        diloco_step_s=diloco,
        synchronous_bytes_per_step=grad_bytes if replicas > 1 else 0.0,
        diloco_bytes_per_step=outer_bytes / sync_every if replicas > 1 else 0.0,
        sync_every=sync_every,
    )
