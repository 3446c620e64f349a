"""Latency-bandwidth models of collectives, priced at the level of the hierarchy a group spans.

Sizes are in bytes of the whole buffer as nccl-tests counts them (all-reduce: the buffer every rank holds;
all-gather / reduce-scatter: the gathered, full buffer; all-to-all: each rank's send buffer). Time is
`steps * latency + bytes * factor / bus_bandwidth`, where `factor` turns algorithm bandwidth into bus
bandwidth exactly as nccl-tests does (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, ...).

A group that stays inside a node runs at the intra-node link's bus bandwidth. A group that crosses nodes is
limited by the NICs its members use: with `k` members per node and one NIC per device, a ring crosses each
node boundary on `k` rails at once, so its bus bandwidth is `min(intra, k * inter)`. An all-to-all is not a
ring: every member sends the share of its buffer meant for other nodes, `(n - k) / n`, through its own NIC,
and the share for its own node's other members, `(k - 1) / n`, over the intra-node link at the same time; the
slower of the two sets its time.

Latency: inside a node every collective pays `steps * latency` with a tree-like step count (the link's
latency is a lumped per-step figure). Across nodes NCCL runs all-reduce as a tree whose latency grows with
log2 of the group, but all-gather and reduce-scatter only as a ring (its tree algorithms are reductions and
broadcasts; PAT, from NCCL 2.23, serves one GPU per node only: NVIDIA/nccl issues #1473 and #1413), and a
ring's latency is one hop per member: NCCL's own model (`ncclTopoTuneModel`, src/graph/tuning.cc) prices
the n - 1 hops as `nodes - 1` network hops and the rest at the intra-node link's latency. So ZeRO-3 / FSDP
gathers over hundreds of ranks pay milliseconds of latency each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loom.cost.hardware import Cluster, Link

__all__ = ["COLLECTIVES", "GroupSpan", "bus_factor", "collective_time", "group_span"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")


@dataclass(frozen=True, kw_only=True)
class GroupSpan:
    """Where a process group's `size` members sit: `per_node` of them in each of `nodes` nodes."""

    size: int
    per_node: int
    nodes: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.nodes < 1:
            raise ValueError(f"GroupSpan: sizes must be >= 1, got {self}")

    @property
    def crosses_nodes(self) -> bool:
        """True when some members are in different nodes."""
        return self.nodes > 1


def group_span(size: int, stride: int, gpus_per_node: int) -> GroupSpan:
    """The span of a group of `size` ranks spaced `stride` apart in the global order (node-major ranks)."""
    if size < 1 or stride < 1 or gpus_per_node < 1:
        raise ValueError(
            f"group_span: size, stride and gpus_per_node must be >= 1 ({size}, {stride}, {gpus_per_node})"
        )
    per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
    return GroupSpan(size=size, per_node=per_node, nodes=math.ceil(size / per_node))


def bus_factor(kind: str, n: int) -> float:
    """Bus bytes moved per byte of the buffer (nccl-tests' busbw / algbw) for a group of `n`."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
    if n <= 1 and kind != "send_recv":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv: every byte crosses one link once


RING_ONLY = ("all_gather", "reduce_scatter")  # collectives NCCL runs only as a ring


def _latency_steps(kind: str, n: int) -> int:
    if kind == "send_recv":
        return 1
    ring = (2 if kind == "all_reduce" else 1) * (n - 1)
    # NCCL picks tree or ring algorithms; latency grows with log2(n) for large groups, like a tree.
    tree = (2 if kind == "all_reduce" else 1) * math.ceil(math.log2(n))
    return min(ring, max(tree, 1))


def _ring_latency(span: GroupSpan, cluster: Cluster) -> float:
    """Seconds of latency of a ring all-gather or reduce-scatter over `span`: its n - 1 hops, of which
    `nodes - 1` cross the network and the others stay on the intra-node link (NCCL's ring model)."""
    inter_hops = span.nodes - 1
    intra_hops = max(span.size, 2) - 1 - inter_hops
    return intra_hops * cluster.intra.latency_s + inter_hops * cluster.inter.latency_s


def collective_time(kind: str, nbytes: float, span: GroupSpan, cluster: Cluster) -> float:
    """Seconds for collective `kind` over `nbytes` on a group placed as `span` in `cluster`."""
    n = span.size
    if n <= 1 and kind != "send_recv":
        return 0.0
    if nbytes <= 0:
        return 0.0
    link: Link = cluster.inter if span.crosses_nodes else cluster.intra
    if kind == "all_to_all" and span.crosses_nodes:
        k = span.per_node
        wire = max(
            nbytes * (n - k) / n / cluster.inter.bus_bandwidth,
            nbytes * (k - 1) / n / cluster.intra.bus_bandwidth,
        )
        return _latency_steps(kind, n) * link.latency_s + wire
    bandwidth = cluster.intra.bus_bandwidth
    if span.crosses_nodes:
        rails = 1 if kind == "send_recv" else span.per_node
        bandwidth = min(bandwidth, rails * cluster.inter.bus_bandwidth)
    if kind in RING_ONLY and span.crosses_nodes:
        latency = _ring_latency(span, cluster)
    else:
        latency = _latency_steps(kind, max(n, 2)) * link.latency_s
    return latency + nbytes * bus_factor(kind, max(n, 2)) / bandwidth
