"""The one place where loom touches private PyTorch APIs.

Each function wraps a private name; `tests/test_mesh.py` checks every one of them so that an upgrade
of PyTorch that moves or renames one fails loudly there instead of deep inside a layer.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh_dims(mesh: DeviceMesh, dim_names: tuple[str, ...], name: str) -> DeviceMesh:
    """A 1-D mesh over the given consecutive dims of `mesh`, registered with the root mesh.

    DTensor's redistribution looks flattened meshes up on the root mesh and then merges consecutive
    collectives of the same kind (two all-gathers over a 2 x 2 mesh become one all-gather over 4 ranks).
    """
    return mesh[dim_names]._flatten(name)


def flattened_meshes(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    """The flattened meshes registered on `mesh`'s root, by name."""
    return dict(mesh._get_root_mesh()._flatten_mapping)


def queue_backward_callback(callback) -> None:  # noqa: ANN001
    """Run `callback` when the current backward pass ends (how DDP finishes its gradient buckets)."""
    import torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def dtensor_like(local, like):  # noqa: ANN001, ANN201
    """A DTensor laid out as DTensor `like` (mesh, placements, global shape and stride) over `local`, left on
    `local`'s device: `DTensor.from_local` would move it to the mesh's device (a CPU copy of a GPU shard
    must stay on the CPU while a checkpoint is written from it)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def local_offset(tensor) -> tuple[int, ...]:  # noqa: ANN001
    """Where a DTensor's local shard starts in the global tensor, per dim (what DCP records for the shard).
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset` is the function DCP itself uses."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(o) for o in offset)


def storage_span(info) -> tuple[str, int, int, bool]:  # noqa: ANN001
    """Where DCP's `FileSystemWriter` put one saved item: (file relative to the checkpoint, offset, length,
    whether stream transforms such as compression were applied). `info` is a value of
    `Metadata.storage_data`, DCP's private `filesystem._StorageInfo`."""
    return info.relative_path, int(info.offset), int(info.length), bool(info.transform_descriptors)


def dcp_metadata_private_globals() -> dict[tuple[str, str], object]:
    """The private names a DCP `.metadata` pickle refers to, by (module, name) as the pickle names them:
    its storage entry class, its memory-format enum and torch's layout lookup (see
    `loom.checkpoint.safe`, which admits these and DCP's public metadata classes only)."""
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    return {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }


def set_nested(state, path, value) -> None:  # noqa: ANN001
    """Put `value` at `path` (DCP's flattening mappings) of the nested state dict `state`, as DCP's
    default load planner does with the values it reads."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state, path, value)


def without_dispatch_modes():  # noqa: ANN201
    """A context in which no `TorchDispatchMode` is active (restored after): loom's own consistency checks
    run their one small collective there, so that a `CommDebugMode` around user code counts only the
    collectives of the computation itself (the check's cost is counted by `loom.dist.consistency.stats`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def dispatch_mode_base() -> type:
    """`TorchDispatchMode`, the base of a mode that sees every operator below autograd (loom's collective
    recorder: c10d and functional collectives are operators there)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def unbox_process_group(boxed):  # noqa: ANN001, ANN201
    """The `ProcessGroup` a c10d operator received (a TorchScript object in the dispatcher)."""
    import torch.distributed as dist

    return dist.ProcessGroup.unbox(boxed)


def group_of_name(name: str):  # noqa: ANN201
    """The `ProcessGroup` a functional collective names by its registered group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_to_all_autograd(rows, output_splits: list[int], input_splits: list[int], group):  # noqa: ANN001, ANN201
    """`all_to_all_single` of `rows` on dim 0 that autograd differentiates (its backward is the reverse
    exchange): the functional collective, private in torch 2.11-2.13."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(rows, output_splits, input_splits, group)


def grouped_mm(rows, weights, ends):  # noqa: ANN001, ANN201
    """`torch._grouped_mm(rows [M, k], weights [G, k, n], ends)`: group `g` multiplies the rows up to
    `ends[g]` (int32 cumulative counts) by `weights[g]`; None when this torch has no such operator."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return None
    return torch._grouped_mm(rows, weights, ends)



def mask_partial_type() -> type:
    """DTensor's masked pending sum (`_MaskPartial`): a vocabulary-cut embedding's output, holding the ids'
    mask in `mask_buffer`."""
    try:
        from torch.distributed.tensor.placement_types import _MaskPartial
    except ImportError:  # where older torch kept it
        from torch.distributed.tensor._ops._embedding_ops import _MaskPartial
    return _MaskPartial


def is_masked_partial(placement) -> bool:  # noqa: ANN001
    """True for a masked pending sum (`mask_partial_type`)."""
    return isinstance(placement, mask_partial_type())
