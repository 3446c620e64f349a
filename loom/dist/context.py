"""`loom.init` and the current mesh, held at the API surface only.

Internal layers take a `Mesh` argument; only the public entry points (`loom.shard`, `loom.ops`,
`loom.parallelize`) read the current mesh, so that a script can call `loom.init()` once and forget it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch.distributed as dist

from loom.dist import env
from loom.dist.mesh import Mesh, MeshShape

_current: Mesh | None = None
_built: dict[tuple[MeshShape, str], Mesh] = {}


def init(mesh: dict[str, int] | None = None, backend: str | None = None, device: str | None = None) -> Mesh:
    """Join the process group (under `loom.launch`, `loom run`, torchrun, or alone) and set the mesh.

    `mesh` names the axes and their sizes, e.g. `{"dp": 2, "tp": 2}`; one size may be -1 to fill in; the
    default puts every device on `"dp"`. `device` is the kind of device the mesh's tensors live on
    (default: "cuda" with NCCL, else "cpu"; "cuda" for ranks that share GPUs over gloo). Calling `init` again is cheap: the same mesh is returned, and a
    different one becomes current (every rank must ask for the same mesh, in the same order).

    `init` seeds no random generator: `loom.launch` and `loom run` seed every rank alike before the user's
    code runs; under torchrun call `loom.seed(n)` after `init` for random tensors that are the same on
    every rank.
    """
    global _current
    env.ensure_process_group(backend)
    shape = MeshShape.from_dict(mesh, dist.get_world_size())
    key = (shape, device or env.device_type())
    if key not in _built:
        _built[key] = Mesh.build(*key)
    _current = _built[key]
    return _current


def current_mesh() -> Mesh | None:
    """The mesh set by the last `loom.init`, or None before it."""
    return _current


def require_mesh(what: str) -> Mesh:
    """The current mesh, or a clear error naming the caller."""
    if _current is None:
        raise RuntimeError(f"{what} needs a device mesh: call loom.init() (or loom.init(mesh={{...}})) first")
    return _current


def rank() -> int:
    """This process's global rank (0 outside a process group)."""
    return env.rank()


def world_size() -> int:
    """The number of processes (1 outside a process group)."""
    return env.world_size()


def forget_meshes() -> None:
    """Drop the current and cached meshes (before a process group is destroyed)."""
    global _current
    _current = None
    _built.clear()


def unsharded() -> AbstractContextManager[None]:
    """Inside the block there is no current mesh: loom operators compute on this process alone, ignoring
    their strategies (for reference runs on one device)."""
    return use_mesh(None)


@contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Inside the block `mesh` is the current mesh (e.g. a pipeline stage's own dp x tp mesh, while the stage
    is laid out and run; None: no mesh), whatever was current before."""
    global _current
    saved, _current = _current, mesh
    try:
        yield
    finally:
        _current = saved
