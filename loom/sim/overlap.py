"""Fully sharded (ZeRO-3 / FSDP) passes as events: each unit's parameter all-gather, its compute, and its
gradient reduce-scatter, with the communication on its own stream beside the compute.

A pass runs units (layers, the embedding, the head) in order. A unit's compute starts when the previous
unit's compute ended and its parameters are gathered. The communication stream runs one collective at a time,
in the order the implementation issues them: with prefetch depth `p`, the all-gather of unit `i + p` is
issued when unit `i`'s compute starts (PyTorch FSDP's and Megatron FSDP's default is one unit ahead), and a
backward's reduce-scatter of unit `i` is issued when its compute ends. The first all-gather has nothing to
hide behind; later ones hide behind compute as far as compute is longer, and what is left over (the exposed
remainder) lengthens the pass.

A reduce-scatter may wait on work of a third stream (`prepare`): PyTorch FSDP1 casts and pre-divides each
unit's gradients on its post-backward stream, which waits for the unit's compute, runs one unit's work at a
time, and is waited on by the unit's reduce-scatter. The reduce-scatter is issued from that stream
(`_reduce_grad` under `torch.cuda.stream(post_backward_stream)`), which then waits for it: the next unit's
preparation starts when this unit's reduce-scatter has ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PREFETCH_DEPTH", "ShardedPass", "sharded_pass"]

PREFETCH_DEPTH = 1  # all-gathers issued ahead of the unit that computes (FSDP's backward/forward prefetch)


@dataclass(frozen=True, kw_only=True)
class ShardedPass:
    """When a sharded pass ends, and how much of that is communication not hidden behind compute."""

    end: float  # seconds from the pass's start until both streams are idle
    compute: float  # seconds of compute alone
    intervals: tuple[
        tuple[str, int, float, float], ...
    ]  # (kind, unit, start, end): "compute", "all_gather", "reduce_scatter", "prepare"

    @property
    def exposed(self) -> float:
        """Seconds the pass takes beyond its compute: communication that did not hide."""
        return self.end - self.compute


def sharded_pass(
    compute: Sequence[float],
    gather: Sequence[float] | None,
    scatter: Sequence[float] | None = None,
    *,
    prefetch: int = PREFETCH_DEPTH,
    prepare: Sequence[float] | None = None,
) -> ShardedPass:
    """Play units with compute `compute[i]` after all-gathers `gather[i]` (None: the units are gathered
    already, as in a backward that keeps them from its forward; and, in backward, reduce-scatters
    `scatter[i]` after each compute, each after `prepare[i]` seconds of work on a stream of its own) on
    two streams; see the module's docstring."""
    n = len(compute)
    if (gather is not None and len(gather) != n) or (scatter is not None and len(scatter) != n):
        raise ValueError("sharded_pass: compute, gather and scatter need one entry per unit")
    if prepare is not None and (scatter is None or len(prepare) != n):
        raise ValueError("sharded_pass: prepare needs scatter and one entry per unit")
    if prefetch < 1:
        raise ValueError(f"sharded_pass: prefetch depth must be >= 1, got {prefetch}")
    intervals: list[tuple[str, int, float, float]] = []
    gathered = [0.0] * n
    comm_free = 0.0

    def issue(kind: str, unit: int, at: float, seconds: float) -> float:
        nonlocal comm_free
        start = max(comm_free, at)
        comm_free = start + seconds
        intervals.append((kind, unit, start, comm_free))
        return comm_free

    for unit in range(min(prefetch, n) if gather is not None else 0):  # issued before the first compute
        gathered[unit] = issue("all_gather", unit, 0.0, gather[unit])
    compute_free = prepare_free = 0.0
    for unit in range(n):
        start = max(compute_free, gathered[unit])
        compute_free = start + compute[unit]
        intervals.append(("compute", unit, start, compute_free))
        if gather is not None and unit + prefetch < n:
            gathered[unit + prefetch] = issue("all_gather", unit + prefetch, start, gather[unit + prefetch])
        if scatter is not None:
            if prepare is None:
                issue("reduce_scatter", unit, compute_free, scatter[unit])
                continue
            ready = max(prepare_free, compute_free) + prepare[unit]
            intervals.append(("prepare", unit, ready - prepare[unit], ready))
            # issued from the post-backward stream, which waits for it to end
            prepare_free = issue("reduce_scatter", unit, ready, scatter[unit])
    return ShardedPass(end=max(compute_free, comm_free), compute=sum(compute), intervals=tuple(intervals))
