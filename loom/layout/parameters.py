"""Laying out a module's parameters as DTensors: each rank keeps only its shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from loom.dist.mesh import Mesh
from loom.layout.redistribute import layout_of
from loom.layout.tensor_layout import TensorLayout


def lay_out_parameters(module: nn.Module, layouts: dict[str, TensorLayout], mesh: Mesh) -> None:
    """Replace every parameter of `module` by a DTensor parameter: `layouts[name]`, its layout when it is a
    DTensor already, or replicated.

    Values come from rank 0 (as DDP broadcasts them), so every rank starts from the same model. A parameter
    shared by several modules (tied weights) stays shared. Parameters on the meta device are laid out empty
    (to be initialised afterwards).
    """
    unknown = sorted(set(layouts) - {name for name, _ in module.named_parameters(remove_duplicate=False)})
    if unknown:
        valid = [name for name, _ in module.named_parameters()]
        raise ValueError(f"parameter_plan names unknown parameter(s) {unknown}; the parameters are {valid}")
    _replace_parameters(module, lambda name, param: _distribute(param, _layout(name, param, layouts), mesh))


def _layout(name: str, param: torch.Tensor, layouts: dict[str, TensorLayout]) -> TensorLayout:
    """`layouts[name]`; otherwise a parameter laid out already (by `loom.shard`) keeps its layout, and any
    other is replicated."""
    if name in layouts:
        return layouts[name]
    if isinstance(param, DTensor):
        return layout_of(param)
    return TensorLayout.replicated(param.ndim)


def materialize(module: nn.Module, device: str | torch.device = "cpu") -> None:
    """Allocate (uninitialised) every meta parameter and buffer of `module` on `device`: for a DTensor,
    only this rank's shard. Parameters become new objects: hook them afterwards."""
    device = torch.device(device)

    def allocate(_: str, param: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            local = torch.empty_like(param.to_local(), device=device)
            return DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                stride=param.stride(),
            )  # fmt: skip
        return torch.empty_like(param, device=device)

    _replace_parameters(module, allocate)
    for name, buffer in list(module.named_buffers()):
        if buffer.is_meta:  # a buffer allocated already may be shared with another module (a model's tables)
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = torch.empty_like(buffer, device=device)


def _replace_parameters(module: nn.Module, make) -> None:  # noqa: ANN001
    """Swap every parameter for `nn.Parameter(make(name, old))`, keeping shared (tied) parameters shared."""
    done: dict[int, nn.Parameter] = {}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in done:
            done[id(param)] = nn.Parameter(make(name, param), requires_grad=param.requires_grad)
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, done[id(param)])


def _distribute(param: torch.Tensor, layout: TensorLayout, mesh: Mesh) -> DTensor:
    placements = layout.placements(mesh.ndim)
    if isinstance(param, DTensor):
        return param.redistribute(mesh.device_mesh, placements).detach()
    if param.is_meta:
        local_shape = [
            size // cut for size, cut in zip(param.shape, layout.cuts(mesh.canonical_shape), strict=True)
        ]
        local = torch.empty(local_shape, dtype=param.dtype, device="meta")
        return DTensor.from_local(
            local, mesh.device_mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return distribute_tensor(param.detach(), mesh.device_mesh, placements)
