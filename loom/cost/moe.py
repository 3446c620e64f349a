"""The collectives of one expert-parallel mixture-of-experts layer (`loom.parallel.experts`).

Per layer call and rank, over the ep group (bytes as `loom.dist.comm` counts an all-to-all: the rank's send
buffer), with `s` rows this rank sends (its token-expert pairs kept after capacity), `r` rows it receives
(pairs routed to its experts by the whole group), `h` hidden and `e` bytes per element:

- forward: the per-expert counts (`experts` int64), the dispatch (`s * h * e`), the combine (`r * h * e`);
- backward: the combine's reverse (the output gradient, `s * h * e`), the dispatch's reverse (`r * h * e`).

`s` and `r` depend on the routing; balanced routing without drops gives `s = r = tokens * top_k`, what
`layer_moe_collectives` predicts for a `TransformerConfig` under a `ParallelPlan` (the rows the simulator's
`loom.cost.layer` prices as its two forward all-to-alls).
"""

from __future__ import annotations

from loom.cost.compute import DTYPE_BYTES
from loom.cost.plan import ParallelPlan
from loom.cost.traffic import StepCollective
from loom.cost.transformer import TransformerConfig

__all__ = ["COUNT_BYTES", "EP", "layer_moe_collectives", "moe_collectives"]

COUNT_BYTES = 8  # the per-expert counts are int64
EP = "ep"


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
        a2a(experts * COUNT_BYTES, "forward", "per-expert counts exchanged"),
        a2a(sent, "forward", "rows dispatched to the ranks holding their experts"),
        a2a(received, "forward", "expert outputs combined back to their tokens' ranks"),
        a2a(sent, "backward", "reverse of the combine: output gradients to the experts' ranks"),
        a2a(received, "backward", "reverse of the dispatch: input gradients back to the tokens' ranks"),
    ]


def layer_moe_collectives(model: TransformerConfig, plan: ParallelPlan) -> list[StepCollective]:
    """Expected all-to-alls of one MoE layer per micro-batch under `plan`: balanced routing, no drops."""
    if not model.is_moe:
        return []
    rows = plan.micro_batch * plan.seq * model.top_k
    if plan.sequence_parallel:
        rows //= plan.tp
    return moe_collectives(
        experts=model.experts, hidden=model.hidden, sent_rows=rows, received_rows=rows,
        element_bytes=DTYPE_BYTES[plan.dtype], ep=plan.ep,
    )  # fmt: skip
