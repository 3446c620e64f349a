"""Processes, process groups and the device mesh."""

from loom.dist import torch_compat
from loom.dist.context import current_mesh, init, rank, world_size
from loom.dist.mesh import Mesh, MeshShape

torch_compat.install()  # before any DTensor is built: the fixes older torch releases need (torch_compat)

__all__ = ["Mesh", "MeshShape", "current_mesh", "init", "rank", "world_size"]
