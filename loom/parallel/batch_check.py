"""Refusing local batches of different sizes: the global batch is the ranks' local batches concatenated.

semi_auto cuts the global batch evenly over the batch axes, so every forward checks the sizes (one tiny
all-reduce). Data parallelism averages the ranks' gradients, so ranks with 4 and 1 rows would weigh each
row differently from one global batch: the sizes of the forwards since the last gradient sync ride along
with the all-reduce with which the ranks already agree on which parameters got gradients (no collective of
their own), and the sync refuses them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.dist._torch_private import without_dispatch_modes
from loom.dist.consistency import mesh_group
from loom.dist.mesh import Mesh

FIX = "give every rank the same number of rows (drop or pad the last batch, e.g. DataLoader(drop_last=True))"


def check_even_batches(tensors: list[torch.Tensor], mesh: Mesh) -> None:
    """Every rank of `mesh` must bring local inputs of the same sizes (one tiny all-reduce; ranks that read
    the same rows bring the same tensors, the batch ranks an even share)."""
    sizes = torch.tensor([float(t.shape[0]) if t.ndim else 0.0 for t in tensors])
    bounds = torch.cat([sizes, -sizes])
    group, _ = mesh_group(mesh)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = bounds[: len(sizes)], -bounds[len(sizes) :]
    if not torch.equal(largest, smallest):
        per_rank = _gather_rows([int(s) for s in sizes.tolist()], group, len(sizes))
        raise ValueError(
            f"the ranks brought local batches of different sizes ({_per_rank(per_rank, group)} rows of the "
            f"inputs in order): the global batch is their concatenation, cut evenly; {FIX}"
        )


class BatchRows:
    """The rows (dim 0 of the first tensor input) of the training forwards since the last gradient sync."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def note(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward pre-hook: remember this forward's rows when it will produce gradients."""
        if not (module.training and torch.is_grad_enabled()):
            return
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.ndim), None)
        if first is not None:
            self.rows.append(int(first.shape[0]))

    def vector(self) -> torch.Tensor:
        """Fingerprint to agree on: the count of forwards, their rows, and their rows weighted by position."""
        weighted = sum((i + 1) * r for i, r in enumerate(self.rows))
        return torch.tensor([len(self.rows), sum(self.rows), weighted], dtype=torch.float64)

    def refuse(self, group: dist.ProcessGroup | None, longest: int) -> None:
        """The error path (every rank saw the disagreement): name each rank's rows and raise."""
        rows, self.rows = self.rows, []  # the next step starts afresh
        per_rank = _gather_rows(rows, group, longest)
        raise ValueError(
            f"loom.parallelize(mode='data_parallel'): the ranks brought local batches of different sizes since "
            f"the last gradient sync ({_per_rank(per_rank, group)} rows per forward); gradients are averaged "
            f"over the ranks, so their rows would not weigh as in one global batch: {FIX}"
        )

    def reset(self) -> None:
        self.rows = []


def _gather_rows(rows: list[int], group: dist.ProcessGroup | None, longest: int) -> list[list[int]]:
    """Every rank's list of rows (at most `longest` entries each)."""
    local = torch.full((longest + 1,), -1, dtype=torch.int64)
    local[0] = len(rows)
    local[1 : 1 + len(rows)] = torch.tensor(rows[:longest], dtype=torch.int64)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    with without_dispatch_modes():
        dist.all_gather(gathered, local, group=group)
    return [g[1 : 1 + int(g[0])].tolist() for g in gathered]


def _per_rank(per_rank: list[list[int]], group: dist.ProcessGroup | None) -> str:
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return ", ".join(
        f"rank {r}: {rows[0] if len(rows) == 1 else rows}" for r, rows in zip(ranks, per_rank, strict=True)
    )
