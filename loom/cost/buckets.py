"""The one rule that packs gradients into buckets: the gradient sync applies it to a model's parameters
(`loom.parallel.grad_sync`), the traffic prediction to a model description (`loom.cost.traffic`).

Gradients arrive in order, each with a key (where it is reduced, its dtype, its level-3 unit) and a size.
Each key keeps one open bucket; a gradient joins its key's open bucket unless that bucket already holds
`bucket_bytes` or more, in which case it opens a new one. So a bucket may end above `bucket_bytes` by at
most one gradient, as in DDP.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["assign_buckets", "bucket_bytes"]


def bucket_bytes(bucket_mb: float) -> int:
    """The byte threshold of `bucket_mb` megabytes (MiB, as DDP counts them)."""
    return int(bucket_mb * 2**20)


def assign_buckets(items: Sequence[tuple[Hashable, int]], threshold: int) -> list[list[int]]:
    """Buckets of `items` ((key, bytes) in arrival order) as lists of item indices, in the order they were
    opened (see the module's docstring)."""
    buckets: list[list[int]] = []
    open_bucket: dict[Hashable, tuple[list[int], list[int]]] = {}  # key -> (indices, [bytes so far])
    for index, (key, nbytes) in enumerate(items):
        current = open_bucket.get(key)
        if current is None or current[1][0] >= threshold:
            current = open_bucket[key] = ([], [0])
            buckets.append(current[0])
        current[0].append(index)
        current[1][0] += nbytes
    return buckets
