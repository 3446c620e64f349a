"""`DistributedBatches`: each data-parallel rank's rows of every global batch, resumable exactly; and
`micro_batches` for gradient accumulation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from loom.train.data.windows import Batch, TokenDataset

__all__ = ["DistributedBatches", "micro_batches"]


class DistributedBatches:
    """This data-parallel rank's rows of each global batch, one step after another, epoch after epoch.

    Each epoch visits the dataset in the order of `torch.randperm(len(dataset))` drawn from a generator
    seeded with `seed + epoch` (or in order when `shuffle=False`); step `k` of an epoch takes the global
    batch `order[k * global_batch : (k + 1) * global_batch]` and this rank keeps rows
    `[dp_rank * local, (dp_rank + 1) * local)`, `local = global_batch // dp_size`. So the global batch is
    the local batches concatenated on dim 0 in dp-rank order, whatever `dp_size` is, and tensor-parallel
    peers (same `dp_rank`) read the same rows. A short last batch is dropped (`drop_last=True`) or filled
    with the first samples of the epoch's order, so every step has `global_batch` rows.

    The iterator is endless; `state_dict()` records `(epoch, index)` so that `load_state_dict` continues
    exactly where a checkpointed run stopped (also with another `dp_size`).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if global_batch < 1 or dp_size < 1:
            raise ValueError(f"global_batch ({global_batch}) and dp_size ({dp_size}) must be >= 1")
        if global_batch % dp_size:
            raise ValueError(
                f"global_batch {global_batch} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if drop_last and len(dataset) < global_batch:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch}; "
                "use more data, a smaller global batch, or drop_last=False"
            )
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.dp_rank, self.dp_size, self.shuffle, self.drop_last = dp_rank, dp_size, shuffle, drop_last
        self.local_batch = global_batch // dp_size
        self.epoch, self.index = 0, 0  # position: samples of this epoch's order already consumed
        self._order: torch.Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one pass over the dataset."""
        n = len(self.dataset)
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(n, generator=generator)
            else:
                self._order = torch.arange(n)
        return self._order

    def _global_indices(self) -> torch.Tensor:
        order = self._epoch_order()
        indices = order[self.index : self.index + self.global_batch]
        if len(indices) < self.global_batch:  # drop_last=False: fill from the start of the epoch
            fill = order.repeat(-(-self.global_batch // len(order)))
            indices = torch.cat([indices, fill[: self.global_batch - len(indices)]])
        return indices

    def _advance(self) -> None:
        self.index += self.global_batch
        if self.index + (self.global_batch if self.drop_last else 1) > len(self.dataset):
            self.epoch, self.index, self._order = self.epoch + 1, 0, None

    def skip(self, steps: int) -> None:
        """Move past the next `steps` global batches without reading them (a replica joining a running
        job at step `steps` continues where its slot's data is)."""
        for _ in range(steps):
            self._advance()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = self._global_indices()[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        samples = [self.dataset[int(i)] for i in rows]
        self._advance()
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    def _identity(self) -> dict[str, Any]:
        """What a saved position depends on: the seed, the dataset's length and, for a dataset that has one
        (a tokenised corpus), the `fingerprint` of its tokens."""
        identity = {"seed": self.seed, "dataset_len": len(self.dataset)}
        fingerprint = getattr(self.dataset, "fingerprint", None)
        if fingerprint is not None:
            identity["fingerprint"] = fingerprint
        return identity

    def state_dict(self) -> dict[str, Any]:
        """The data position (and what it depends on), for a checkpoint."""
        return {"epoch": self.epoch, "index": self.index, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state_dict` (the same dataset and seed are required)."""
        for key, mine in self._identity().items():
            if key in state and state[key] != mine:
                raise ValueError(
                    f"the saved data position has {key}={state[key]} but this loader has {key}={mine}; "
                    "resume with the data settings of the checkpointed run"
                )
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None


def micro_batches(batch: Sequence[torch.Tensor], n: int) -> list[tuple[torch.Tensor, ...]]:
    """Split a local batch (tensors sharing dim 0) into `n` gradient-accumulation micro-batches."""
    rows = batch[0].shape[0]
    if n < 1 or rows % n:
        raise ValueError(
            f"a local batch of {rows} rows cannot be split into {n} micro-batches; "
            "make global_batch divisible by dp * grad_accum"
        )
    return list(zip(*(t.chunk(n, dim=0) for t in batch), strict=True))
