"""Processes, process groups and the device mesh."""

from loom.dist.context import current_mesh, init, rank, world_size
from loom.dist.mesh import Mesh, MeshShape

__all__ = ["Mesh", "MeshShape", "current_mesh", "init", "rank", "world_size"]
