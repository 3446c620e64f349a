"""loom: train ordinary PyTorch models across many devices.

The public API (see DESIGN.md): processes and mesh (`launch`, `seed`, `init`, `rank`, `world_size`, `current_mesh`),
MindSpore-style sharding (`Layout`, `shard`, `ops`), whole models (`parallelize`, `full`).
"""

from loom import ops
from loom.dist.context import current_mesh, init, rank, world_size
from loom.dist.launch import launch
from loom.dist.mesh import Mesh
from loom.dist.rng import seed
from loom.layout import Layout, full
from loom.parallel import parallelize
from loom.shard import shard

__all__ = [
    "Layout",
    "Mesh",
    "current_mesh",
    "full",
    "init",
    "launch",
    "ops",
    "parallelize",
    "rank",
    "seed",
    "shard",
    "world_size",
]
