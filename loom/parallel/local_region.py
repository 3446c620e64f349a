"""Local regions: a module of a semi_auto model run on each rank's own rows, with plain tensors.

Some modules cannot run on DTensors: a mixture of experts routes tokens with data-dependent shapes
(`nonzero`, `where`), for which DTensor has no sharding rule. Such a module computes each row of its output
(dim 0: a token, a sequence) from the same rows of its inputs, so each rank can run it on its own rows.
`run_locally` wraps the module's forward: DTensor inputs are brought to one layout (rows cut along the
batch axes, everything else gathered), the module runs on the local pieces with its parameters as local
tensors, and the outputs become DTensors with the inputs' placements again.

A parameter is computed with whole, so each rank's gradient covers only its own rows: the local parameters
are taken with `to_local(grad_placements=...)` as pending sums over the mesh dims that cut the rows, which
the semi_auto model's gradient synchronisation reduces like any other. A parameter kept cut (a Plan's
`parameter_layouts`) is gathered whole first; its gather's backward reduces that pending sum back to the
cut (a reduce-scatter), so nothing is left for the synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.utils._pytree import tree_flatten, tree_map

from loom.layout.placements import pending_over_rows, row_placements

__all__ = ["run_locally", "run_normally"]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (for a DTensor built from its local piece)."""
    return torch.empty(tuple(shape), device="meta").stride()


def run_locally(module: nn.Module, path: str) -> None:
    """Make `module` (at `path` in its model) run on local rows whenever its inputs are DTensors."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        flat, _ = tree_flatten((args, kwargs))
        like = next((x for x in flat if isinstance(x, DTensor)), None)
        if like is None:
            return original(*args, **kwargs)
        mesh, rows = like.device_mesh, like.shape[0]
        placements = row_placements(like.placements)
        whole = [Replicate()] * mesh.ndim
        local_rows: list[int] = []  # this rank's row count, seen on the first row-wise input

        def local(x: Any) -> Any:
            """A row-wise input (as many rows as the first) becomes this rank's rows; any other (a broadcast
            table, a per-expert table, a scalar) comes whole."""
            if not isinstance(x, DTensor):
                return x
            if x.ndim > 0 and x.shape[0] == rows:
                piece = x.redistribute(mesh, placements).to_local()
                local_rows.append(piece.shape[0])
                return piece
            return x.redistribute(mesh, whole).to_local()

        args, kwargs = tree_map(local, (args, kwargs))
        grads = pending_over_rows(placements)
        with _local_parameters(module, grads):
            out = original(*args, **kwargs)
        return tree_map(lambda t: _row_output(t, path, mesh, placements, rows, local_rows[0]), out)

    module.forward = forward
    module.loom_local = True


def run_normally(model: nn.Module) -> None:
    """Undo `run_locally` in `model`: each local region runs its class's forward again. For a copy of a
    model gathered whole (`copy.deepcopy` shares the wrapper, which calls the original module's forward,
    with the original's sharded parameters), which computes on plain tensors anyway."""
    for module in model.modules():
        if module.__dict__.pop("loom_local", False):
            del module.forward  # the instance's wrapper; the class's forward shows through


def _row_output(t: Any, path: str, mesh: Any, placements: list[Placement], rows: int, local_rows: int) -> Any:
    """A local output row-wise as the inputs: the DTensor of all ranks' rows; anything else is an error (a
    local region must compute each output row from the same input rows)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.ndim == 0 or t.shape[0] != local_rows:
        raise ValueError(
            f"{path} runs as a local region (module plan 'local': True), which must compute each row of its "
            f"outputs from the same rows of its inputs, but it returned a tensor of shape {tuple(t.shape)} for "
            f"{local_rows} local rows; leave it out of the local regions"
        )
    shape = (rows, *t.shape[1:])
    return DTensor.from_local(
        t, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
    )


@contextmanager
def _local_parameters(module: nn.Module, grad_placements: list[Placement]) -> Iterator[None]:
    """Inside the block, the module's DTensor parameters are whole local tensors, whose gradients flow back
    as pending sums over the row-cutting mesh dims. A parameter kept cut is gathered first (an all-gather
    per cut axis): its gradient is then reduced back to its cut (a reduce-scatter where pending) by the
    gather's own backward."""
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for name, param in list(module.named_parameters()):
            if not isinstance(param, DTensor):
                continue
            whole = param
            if any(not p.is_replicate() for p in param.placements):
                whole = param.redistribute(param.device_mesh, [Replicate()] * param.device_mesh.ndim)
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            saved.append((owner, leaf, param))
            owner._parameters[leaf] = whole.to_local(grad_placements=grad_placements)
        yield
    finally:
        for owner, leaf, param in saved:
            owner._parameters[leaf] = param
