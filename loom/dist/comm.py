"""Counting the collectives a piece of code issues, by kind (for tests, the demo and benchmarks)."""

from __future__ import annotations

from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all", "broadcast", "send", "recv")


def collective_kind(op_name: str) -> str:
    """`c10d_functional.all_gather_into_tensor` and `c10d.allgather_` are both `all_gather`."""
    plain = op_name.split(".")[-1].replace("_", "")
    for kind in KINDS:
        if kind.replace("_", "") in plain:
            return kind
    return plain


def collective_counts(comm: CommDebugMode) -> dict[str, int]:
    """The collectives a `CommDebugMode` block saw, counted by kind."""
    counts: Counter[str] = Counter()
    for op, count in comm.get_comm_counts().items():
        counts[collective_kind(str(op))] += count
    return dict(counts)
