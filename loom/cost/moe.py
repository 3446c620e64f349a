"""The collectives of one expert-parallel mixture-of-experts layer (`loom.parallel.experts`).

Per layer call and rank, over the ep group (bytes as `loom.dist.comm` counts an all-to-all: the rank's send
buffer), with `s` rows this rank sends (its token-expert pairs kept after capacity), `r` rows it receives
(pairs routed to its experts by the whole group), `h` hidden and `e` bytes per element:

- forward: the per-expert counts (`experts` int64), the dispatch (`s * h * e`), the combine (`r * h * e`);
- backward: the combine's reverse (the output gradient, `s * h * e`), the dispatch's reverse (`r * h * e`).

`s` and `r` depend on the routing; balanced routing without drops gives `s = r = tokens * top_k`, what
`layer_moe_collectives` predicts for a `TransformerConfig` under a `ParallelPlan` (the rows the simulator's
`loom.cost.layer` prices as its two forward all-to-alls).

DeepEP (`ParallelPlan.moe_dispatcher = "deepep"`, deepseek-ai/DeepEP's normal kernels, Megatron-Core's
`--moe-token-dispatcher-type flex`) sends a token once per destination rank, not once per routed expert
(its layout is `is_token_in_rank[tokens, ranks]`); across nodes its internode kernels send it once per
destination node over RDMA, to the rank of the source's local index there (`rdma_rank = rank / 8`,
`nvl_rank = rank % 8`), which forwards it over NVLink to the node's ranks that hold its experts
(`SourceMeta.is_token_in_nvl_rank_bits`); the combine runs the reverse, reducing inside the node first.
With experts placed contiguously (rank r holds experts r E / ep ...) and top-k distinct experts drawn
uniformly, `expected_groups_hit` gives how many nodes and ranks a token reaches: `deepep_bytes`.
"""

from __future__ import annotations

import math

from loom.cost.collectives import GroupSpan, collective_time
from loom.cost.compute import DTYPE_BYTES
from loom.cost.hardware import Cluster
from loom.cost.plan import ParallelPlan
from loom.cost.traffic import StepCollective
from loom.cost.transformer import TransformerConfig

__all__ = [
    "COUNTS",
    "COUNT_BYTES",
    "EP",
    "deepep_bytes",
    "deepep_layer_time",
    "deepep_time",
    "expected_groups_hit",
    "layer_moe_collectives",
    "moe_collectives",
]

COUNT_BYTES = 8  # the per-expert counts are int64
EP = "ep"
COUNTS = "per-expert counts exchanged"  # the source of the counts' all-to-all


def moe_collectives(
    *, experts: int, hidden: int, sent_rows: int, received_rows: int, element_bytes: int, ep: int
) -> list[StepCollective]:
    """All-to-alls of one expert-parallel MoE call on one rank (see the module's docstring); none at ep 1."""
    if ep <= 1:
        return []
    sent, received = sent_rows * hidden * element_bytes, received_rows * hidden * element_bytes

    def a2a(nbytes: int, phase: str, source: str) -> StepCollective:
        return StepCollective(kind="all_to_all", axis=EP, nbytes=nbytes, count=1, phase=phase, source=source)

    return [
        a2a(experts * COUNT_BYTES, "forward", COUNTS),
        a2a(sent, "forward", "rows dispatched to the ranks holding their experts"),
        a2a(received, "forward", "expert outputs combined back to their tokens' ranks"),
        a2a(sent, "backward", "reverse of the combine: output gradients to the experts' ranks"),
        a2a(received, "backward", "reverse of the dispatch: input gradients back to the tokens' ranks"),
    ]


def layer_moe_collectives(model: TransformerConfig, plan: ParallelPlan) -> list[StepCollective]:
    """Expected all-to-alls of one MoE layer per micro-batch under `plan`: balanced routing, no drops."""
    if not model.is_moe:
        return []
    rows = _routed_tokens(model, plan) * model.top_k
    return moe_collectives(
        experts=model.experts, hidden=model.hidden, sent_rows=rows, received_rows=rows,
        element_bytes=DTYPE_BYTES[plan.dtype], ep=plan.ep,
    )  # fmt: skip


def _routed_tokens(model: TransformerConfig, plan: ParallelPlan) -> int:
    """Tokens one rank routes per MoE layer and micro-batch: its sequence-parallel share under sp."""
    tokens = plan.micro_batch * plan.seq
    return tokens // plan.tp if plan.sequence_parallel else tokens


def expected_groups_hit(experts: int, top_k: int, groups: int) -> float:
    """Expected number of distinct groups a token's `top_k` distinct experts fall in, the `experts` placed
    contiguously in `groups` equal groups (ranks, or nodes) and drawn uniformly without replacement: each
    group of m = experts / groups is missed with probability C(experts - m, top_k) / C(experts, top_k)."""
    if min(experts, top_k, groups) < 1 or experts % groups or top_k > experts:
        raise ValueError(
            f"{top_k} of {experts} experts in {groups} groups: give 1 <= top_k <= experts and groups dividing experts"
        )
    held = experts // groups
    missed = math.comb(experts - held, top_k) / math.comb(experts, top_k)
    return groups * (1 - missed)


def deepep_bytes(model: TransformerConfig, plan: ParallelPlan, span: GroupSpan) -> tuple[float, float]:
    """Bytes one rank of an ep group placed as `span` sends in one DeepEP dispatch (or combine) of one MoE
    layer and micro-batch, in expectation: (over RDMA, over NVLink). Each of its tokens goes once to every
    other node holding one of its experts (RDMA), and each rank that receives it for a node, the source's
    counterpart there (the source itself in its own node), forwards it to the node's other ranks that hold
    one of its experts (NVLink): (nodes - 1) p_node copies over RDMA and (ep - nodes) p_rank over NVLink,
    where p_node and p_rank are the chances a node and a rank hold one of the token's experts. Inside one
    node it is sent to each rank holding one of its experts: (ep - 1) p_rank copies over NVLink."""
    tokens = _routed_tokens(model, plan) * model.hidden * DTYPE_BYTES[plan.dtype]  # one copy of each
    nodes, ep = span.nodes, span.size
    per_rank = expected_groups_hit(model.experts, model.top_k, ep) / ep
    if nodes == 1:
        return 0.0, tokens * (ep - 1) * per_rank
    per_node = expected_groups_hit(model.experts, model.top_k, nodes) / nodes
    return tokens * (nodes - 1) * per_node, tokens * (ep - nodes) * per_rank


def deepep_time(model: TransformerConfig, plan: ParallelPlan, span: GroupSpan, cluster: Cluster) -> float:
    """Seconds of one DeepEP dispatch or combine (`deepep_bytes`): its RDMA sends through the rank's own NIC
    and its NVLink forwards run at once (the kernels forward each chunk as it arrives), so the slower sets
    the time, after one network hop's latency (across nodes) and one NVLink hop's."""
    rdma, nvlink = deepep_bytes(model, plan, span)
    latency = cluster.intra.latency_s + (cluster.inter.latency_s if span.crosses_nodes else 0.0)
    return latency + max(rdma / cluster.inter.bus_bandwidth, nvlink / cluster.intra.bus_bandwidth)


def deepep_layer_time(
    model: TransformerConfig, plan: ParallelPlan, span: GroupSpan, cluster: Cluster, phase: str
) -> float:
    """Seconds of one MoE layer's expert-parallel exchanges in `phase` under DeepEP: forward the per-expert
    counts (an all-to-all, as `moe_collectives`), the dispatch and the combine; backward the combine's
    reverse (a dispatch of the output gradients) and the dispatch's reverse (a combine); none at ep 1."""
    if not model.is_moe or plan.ep == 1:
        return 0.0
    counts = sum(
        collective_time(c.kind, c.nbytes, span, cluster)
        for c in layer_moe_collectives(model, plan)
        if c.phase == phase and c.source == COUNTS
    )
    return counts + 2 * deepep_time(model, plan, span, cluster)
