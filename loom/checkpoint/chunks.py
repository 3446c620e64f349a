"""Tensors a rank holds in pieces, saved and loaded by `torch.distributed.checkpoint` (DCP) as they are.

At optimizer levels 1-3 a rank holds, for every gradient bucket, one chunk: a flat range of the bucket's
elements, which cuts across its parameters. One parameter's elements in a chunk are a flat range of its
local shard (C order), and a flat range of an n-dimensional tensor is a union of at most 2n - 1 boxes
(a partial row, whole rows, a partial row, recursively). Each box is contiguous in the chunk, and a box of
the local shard is a box of the global parameter (shifted by the shard's offset), which is what DCP's
storage metadata describes: so every rank saves its own chunks as chunks of per-parameter tensors, with no
collective, and DCP reshards them at load onto any layout (a DTensor, a plain tensor, or other pieces).

`Pieces` holds such boxes; `PiecesSavePlanner` and `PiecesLoadPlanner` are DCP's default planners taught
to save and load them (DCP's planners are its public extension point).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from loom.checkpoint.safe import SafeLoadPlanner
from loom.checkpoint.storage import memory_of
from loom.dist._torch_private import local_offset
from loom.dist.local import local_tensor

# A box of a tensor: (offsets, sizes), one entry per dim.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The boxes that make up elements [lo, hi) of a C-contiguous tensor of `shape`, in order; each box is
    itself a contiguous run of those elements."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # within one row of dim 0: a box one row high around the inner dims' boxes
        return [
            ((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo % inner, hi - first * inner)
        ]
    boxes: list[Box] = []
    if lo % inner:  # the end of a partial first row
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo % inner, inner)]
        first += 1
    whole_end = hi // inner
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if hi % inner:  # the start of a partial last row
        boxes += [((whole_end, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, hi % inner)]
    return boxes


@dataclass(frozen=True)
class Piece:
    """One box of a global tensor (offsets into it) and the values this rank holds for it."""

    offsets: tuple[int, ...]
    values: torch.Tensor  # shaped like the box


@dataclass(frozen=True)
class Pieces:
    """The boxes of one global tensor (`size`, `dtype`) that this rank holds. DCP saves each box as a chunk
    of the tensor and, as a load target, fills each box from whatever chunks the checkpoint has."""

    size: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.values.shape) for p in self.pieces
        ]

    def write_items(self, fqn: str) -> list[WriteItem]:
        """DCP's write items for the boxes (the shape of the items it makes for a DTensor's shard)."""
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(self.size)),
            )
            for chunk in self.chunks()
        ]

    def at(self, offsets: tuple[int, ...]) -> torch.Tensor:
        """The values of the box at `offsets`."""
        for piece in self.pieces:
            if tuple(piece.offsets) == tuple(offsets):
                return piece.values
        raise KeyError(f"no piece at offsets {tuple(offsets)}")

    def map(self, fn: Any) -> Pieces:
        """The same boxes with `fn(values)` as values (e.g. copies)."""
        return dataclasses.replace(self, pieces=tuple(Piece(p.offsets, fn(p.values)) for p in self.pieces))


def pieces_of(tensor: torch.Tensor, flat: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> Pieces:
    """Elements [lo, hi) of `tensor`'s local shard (a parameter, or a tensor laid out like it), whose values
    are `flat` (hi - lo elements, e.g. a slice of a chunk), as boxes of the global tensor. The values are
    views of `flat`, cast to `dtype` when it differs."""
    shape = tuple(local_tensor(tensor).shape)
    shift = local_offset(tensor) if isinstance(tensor, DTensor) else (0,) * len(shape)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    pieces, start = [], lo
    for offsets, sizes in flat_range_boxes(shape, lo, hi):
        count = math.prod(sizes)
        values = flat[start - lo : start - lo + count].view(sizes)
        pieces.append(Piece(tuple(o + s for o, s in zip(offsets, shift, strict=True)), values))
        start += count
    return Pieces(tuple(tensor.shape), dtype, tuple(pieces))


def _exact_storage(values: torch.Tensor) -> torch.Tensor:
    """`values` on memory of its own size, without a copy where possible: DCP's writer copies a tensor that
    views a larger storage (`torch.save` would write all of it), and a chunk's boxes all are such views."""
    if values.device.type != "cpu" or not values.is_contiguous() or values.dim() == 0 or values.numel() == 0:
        return values
    if values.untyped_storage().nbytes() == values.nbytes:
        return values
    return torch.frombuffer(memory_of(values.detach()), dtype=values.dtype).view(values.shape)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also saves `Pieces` (each box a chunk of its tensor)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()  # its items for `Pieces` (opaque objects to it) are replaced
        pieces = {fqn: obj for fqn, obj in self.state_dict.items() if isinstance(obj, Pieces)}
        items = [item for item in plan.items if item.index.fqn not in pieces]
        for fqn, obj in pieces.items():
            items += obj.write_items(fqn)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return _exact_storage(obj.at(tuple(index.offset)))
        return super().lookup_object(index)


class PiecesLoadPlanner(SafeLoadPlanner):
    """DCP's default load planner (reading saved values without running code: `SafeLoadPlanner`), which also
    fills `Pieces` (each box from the chunks that overlap it)."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        # The default set-up replaces values it does not know (such as `Pieces`) with None as it prepares the
        # state dict: it sees an empty tensor in each one's place instead, swapped back once flattened.
        stand_ins: dict[int, Pieces] = {}
        _swap_pieces(state_dict, stand_ins)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            _swap_pieces(state_dict, stand_ins)
        self.state_dict = {fqn: stand_ins.get(id(value), value) for fqn, value in self.state_dict.items()}

    def create_local_plan(self) -> LoadPlan:
        # The default plan for everything else (without the default planner's handling of checkpoints
        # written by torch 2.3 and earlier, which loom's are not), then the reads that fill the boxes.
        assert self.metadata is not None
        pieces = {fqn: obj for fqn, obj in self.state_dict.items() if isinstance(obj, Pieces)}
        rest = {fqn: obj for fqn, obj in self.state_dict.items() if fqn not in pieces}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, obj in pieces.items():
            if fqn not in self.metadata.state_dict_metadata:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            saved = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, saved, obj.chunks())
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.pieces[index.index].values if index.index is not None else obj.at(tuple(index.offset))
        return super().lookup_tensor(index)


def _swap_pieces(state: dict[str, Any], stand_ins: dict[int, Pieces]) -> None:
    """In the nested dict `state`, in place: each `Pieces` becomes an empty tensor standing in for it
    (recorded in `stand_ins` by the tensor's id), and each stand-in becomes its `Pieces` again."""
    for key, value in state.items():
        if isinstance(value, dict):
            _swap_pieces(value, stand_ins)
        elif isinstance(value, Pieces):
            stand_in = torch.empty(0)
            stand_ins[id(stand_in)] = value
            state[key] = stand_in
        elif torch.is_tensor(value) and id(value) in stand_ins:
            state[key] = stand_ins[id(value)]
