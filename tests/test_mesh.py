"""Tier 2: loom.init builds the named, canonical and flattened meshes; the private-API adapter still works."""

import pytest
import torch.distributed as dist

import loom
from loom.dist import _torch_private


def mesh_case():
    mesh = loom.init({"dp": -1, "tp": 2})
    again = loom.init({"dp": 2, "tp": 2})
    flattened = sorted(_torch_private.flattened_meshes(mesh.device_mesh))
    dp_ranks = dist.get_process_group_ranks(mesh["dp"].get_group())
    tp_ranks = dist.get_process_group_ranks(mesh["tp"].get_group())
    try:
        loom.init({"dp": 3, "tp": 2})
        error = None
    except ValueError as caught:
        error = str(caught)
    return mesh is again, repr(mesh), flattened, dp_ranks, tp_ranks, error, loom.current_mesh() is mesh


def test_init_builds_named_mesh_and_is_idempotent(dist_run):
    for rank, result in enumerate(dist_run(4, mesh_case)):
        same, text, flattened, dp_ranks, tp_ranks, error, current = result
        assert same and current
        assert text == "Mesh(dp=2, tp=2; canonical 2 x 2)"
        assert flattened == ["dp+tp"]  # the one run of consecutive canonical dims, registered for DTensor
        assert dp_ranks == [rank % 2, rank % 2 + 2] and tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert "mesh {'dp': 3, 'tp': 2} has 6 devices but the world size is 4" in error


def eight_rank_flattening_case():
    mesh = loom.init({"dp": 2, "tp": 4})
    return sorted(_torch_private.flattened_meshes(mesh.device_mesh)), mesh["tp"].size()


def test_every_run_of_canonical_dims_is_flattened(dist_run):
    for flattened, tp_size in dist_run(8, eight_rank_flattening_case):
        assert flattened == ["dp+tp_0", "dp+tp_0+tp_1", "tp_0+tp_1"]
        assert tp_size == 4


def test_private_torch_apis_exist():
    """Fails loudly when PyTorch moves a private name loom relies on (see loom/dist/_torch_private.py)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    assert callable(DeviceMesh._flatten)
    assert hasattr(DeviceMesh, "_get_root_mesh")
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)
    from torch.utils._python_dispatch import _disable_current_modes  # loom.dist.consistency's quiet check

    assert callable(_disable_current_modes)
    from torch.distributed import ProcessGroup  # loom.dist.comm's recorder
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    assert callable(ProcessGroup.unbox) and callable(_resolve_process_group)
    assert hasattr(TorchDispatchMode, "__torch_dispatch__")
    # loom.layout.redistribute: a vocabulary-cut embedding's masked pending sum
    import dataclasses

    from torch.distributed.tensor import Partial

    from loom.dist._torch_private import is_masked_partial, mask_partial_type

    assert "mask_buffer" in {f.name for f in dataclasses.fields(mask_partial_type())}
    assert not is_masked_partial(Partial())


def dtensor_like_case():
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = loom.init({"dp": 2})
    whole = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(whole, mesh.device_mesh, [Shard(0)])
    copy = _torch_private.dtensor_like(sharded.to_local().clone(), sharded)
    return copy.placements == sharded.placements and torch.equal(copy.full_tensor(), whole)


def test_dtensor_like_keeps_the_layout(dist_run):
    """`_torch_private.dtensor_like` (DTensor's private constructor) still builds the same layout."""
    assert dist_run(2, dtensor_like_case) == [True, True]


@pytest.mark.parametrize("bad", [{"dp": 0}, {"dp": -1, "tp": -1}])
def test_bad_mesh_dicts_fail_before_any_process_group(bad):
    with pytest.raises(ValueError):
        loom.dist.MeshShape.from_dict(bad, 4)


def checkpoint_private_case(root):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = loom.init({"dp": 2})
    whole = torch.arange(12.0).reshape(4, 3)
    sharded = distribute_tensor(whole, mesh.device_mesh, [Shard(0)])
    offset = _torch_private.local_offset(sharded)
    dcp.save({"w": sharded}, checkpoint_id=root)
    metadata = dcp.FileSystemReader(root).read_metadata()
    spans = sorted(_torch_private.storage_span(info) for info in metadata.storage_data.values())
    return offset, spans


def test_checkpoint_private_apis_keep_their_meaning(dist_run, tmp_path):
    """`local_offset` (DTensor's shard offsets, as DCP computes them) and `storage_span` (where DCP's file
    writer put an item: its private `_StorageInfo`) still mean what the checkpoint code relies on."""
    (offset, spans), (other, _) = dist_run(2, checkpoint_private_case, str(tmp_path))
    assert offset == (0, 0) and other == (2, 0)
    assert [(path, transformed) for path, _, _, transformed in spans] == [
        ("__0_0.distcp", False),
        ("__1_0.distcp", False),
    ]
    assert all(offset >= 0 and length > 0 for _, offset, length, _ in spans)
    assert [(tmp_path / path).stat().st_size for path, *_ in spans] == [o + n for _, o, n, _ in spans]
