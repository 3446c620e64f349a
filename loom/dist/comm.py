"""Counting and recording the collectives a piece of code issues (for tests, the demo and benchmarks).

`collective_counts` counts a `CommDebugMode` block by kind. `CollectiveRecorder` records every collective
a block issues, DTensor's functional collectives and direct `torch.distributed` calls alike (gradient
buckets, ZeRO's gathers): both reach the dispatcher as `_c10d_functional.*` and `c10d.*` operators, which a
`TorchDispatchMode` sees with their tensors and process group.

Bytes follow one convention, nccl-tests' (and `loom.cost.collectives`'): the whole buffer of the collective
as one rank holds it. all-reduce and broadcast: the buffer; all-gather: the gathered output; reduce-scatter:
the input before scattering; all-to-all: the rank's send buffer; send, receive and reduce: the buffer;
gather to one rank: the rank's contribution; scatter from one rank: the piece each rank receives.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves

from loom.dist._torch_private import dispatch_mode_base, group_of_name, unbox_process_group

# longer names first: "allreduce" and "reducescatter" contain "reduce"
KINDS = (
    "reduce_scatter", "all_gather", "all_reduce", "all_to_all", "broadcast", "send", "recv",
    "gather", "scatter", "reduce",
)  # fmt: skip

# operator namespaces of collectives: process-group calls, and the functional collectives DTensor issues
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
# which argument holds the buffer each kind is sized by (see the module's docstring)
_SIZED_BY = {
    "all_reduce": ("tensors", "input", "inputs"),
    "broadcast": ("tensors", "input"),
    "all_gather": ("output_tensors", "output_tensor", "output", "input"),
    "reduce_scatter": ("input_tensors", "input_tensor", "input", "inputs"),
    "all_to_all": ("input_tensors", "input", "input_tensor"),
    "send": ("tensors",),
    "recv": ("tensors",),
    "gather": ("input_tensors",),
    "scatter": ("output_tensors",),
    "reduce": ("tensors",),
}


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


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it: its kind (one of `KINDS`), the global ranks of its group, and
    its size in bytes (the module's convention)."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int

    @property
    def group_size(self) -> int:
        """Ranks taking part."""
        return len(self.ranks)


class CollectiveRecorder(dispatch_mode_base()):
    """Inside `with CollectiveRecorder() as rec:`, every collective this rank issues is appended to
    `rec.calls` (a `Collective`), in issue order. Operations on DTensors pass through untouched, so that
    DTensor turns them into the functional collectives recorded here."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace = func.namespace
        if namespace in _NAMESPACES:
            kind = collective_kind(func.__name__.split(".")[0])
            if kind in KINDS:
                self.calls.append(_describe(func, kind, args, kwargs))
        return func(*args, **kwargs)

    def summary(self, axes: dict[tuple[int, ...], str] | None = None) -> Counter:
        """`Counter` of (kind, group, bytes) -> calls, where group is the axis name `axes` gives the group's
        ranks (`mesh_axes`), or else the group's size."""
        return summarize(self.calls, axes)


def summarize(calls: Iterable[Collective], axes: dict[tuple[int, ...], str] | None = None) -> Counter:
    """Counter of (kind, axis name or group size, bytes) over `calls` (see `CollectiveRecorder.summary`)."""
    axes = axes or {}
    return Counter((c.kind, axes.get(c.ranks, c.group_size), c.nbytes) for c in calls)


def _describe(func, kind: str, args: tuple, kwargs: dict) -> Collective:
    names = [argument.name for argument in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    return Collective(kind=kind, ranks=_group_ranks(bound), nbytes=_payload(kind, bound))


def _group_ranks(bound: dict) -> tuple[int, ...]:
    if "process_group" in bound:
        group = unbox_process_group(bound["process_group"])
    else:
        group = group_of_name(bound["group_name"])
    return tuple(dist.get_process_group_ranks(group))


def _payload(kind: str, bound: dict) -> int:
    """Bytes of the buffer `kind` is sized by; a functional all-gather names only its input, whose gathered
    output is group_size times as large."""
    for name in _SIZED_BY[kind]:
        if name in bound:
            nbytes = _nbytes(bound[name])
            if kind == "all_gather" and name == "input":
                nbytes *= int(bound["group_size"])
            return nbytes
    raise AssertionError(f"no buffer argument among {sorted(bound)} for a {kind}")


def _nbytes(value) -> int:
    """Bytes of a tensor; of a list of per-rank lists, this rank's first list (c10d's list-of-lists)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def mesh_axes(names: Sequence[str], sizes: Sequence[int], rank: int) -> dict[tuple[int, ...], str]:
    """The ranks of `rank`'s group along each set of named mesh axes (row-major ranks, `names` outermost
    first), named like "dp", "tp" or "dp+tp": to read a recorded group as the axes it spans."""
    coords = torch.unravel_index(torch.tensor(rank), tuple(sizes))
    grid = torch.arange(int(torch.tensor(sizes).prod())).reshape(tuple(sizes))
    axes: dict[tuple[int, ...], str] = {}
    for count in range(len(names), 0, -1):  # single axes last: they win for a size-1 companion
        for subset in itertools.combinations(range(len(names)), count):
            index = tuple(slice(None) if d in subset else int(coords[d]) for d in range(len(names)))
            ranks = tuple(int(r) for r in grid[index].flatten())
            axes[ranks] = "+".join(names[d] for d in subset)
    return axes
