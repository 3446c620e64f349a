"""Activation memory of a stage: bytes of the tensors autograd saves for backward, live at each moment.

`saved_tensors_hooks` wraps every saved tensor in a small handle; the handle's bytes are counted while
autograd holds it and released when autograd drops it (after that micro-batch's backward), so the peak is
measured, not modelled. Parameters (and views of them) are not activations and are not counted; a storage
saved several times counts once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


class _Saved:
    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tracker: SavedActivations, key: int, tensor: torch.Tensor) -> None:
        self.tracker, self.key, self.tensor = tracker, key, tensor

    def __del__(self) -> None:
        self.tracker._release(self.key)


class SavedActivations:
    """Live and peak bytes of saved activations produced under `hooks()`."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._parameters = list(parameters)
        self._excluded: set[int] = set()
        self._storages: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.live = 0
        self.peak = 0

    def hooks(self) -> saved_tensors_hooks:
        """The context under which forward work is tracked (parameters sharded at rest, optimizer level 3,
        live at other addresses each time they are gathered: they are looked up again here)."""
        self._excluded = {p.untyped_storage().data_ptr() for p in self._parameters}
        return saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = _storage(tensor)
        key = storage.data_ptr()
        if key == 0 or key in self._excluded:
            return tensor
        entry = self._storages.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._storages[key]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding `tensor`'s data. A wrapper tensor has none of its own: a DTensor (tensor-parallel
    stages) holds its local piece, an exchange's result still waiting on its collective (experts' rows, an
    `AsyncCollectiveTensor`) the tensor it will be; their first inner tensor (`__tensor_flatten__`) is
    counted."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = flatten()
        return _storage(getattr(local, names[0]))
    return local.untyped_storage()
