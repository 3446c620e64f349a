"""Random generators derived per step and per rank, so that a run draws the same numbers on any restart.

`StepSeeds.apply(step)` seeds every generator of this process at the start of a training step from the run's
seed, the step and the rank's coordinates on the mesh, as JAX folds a step and a device index into a key.
What a rank draws in a step then depends on nothing that came before it: a run resumed on another mesh (or
world size) draws what a fresh run on that mesh draws at that step, and one resumed on the same mesh what the
uninterrupted run drew. (`loom.Trainer(seed=...)` applies it; `loom train` passes `train.seed`.)

Which coordinates count:
- torch's CPU generator, Python's `random` and NumPy's legacy generator, which draw on a rank's own tensors:
  the rank's index on every mesh axis but `tp`. Tensor-parallel peers compute on the same data (a
  replicated activation must stay replicated), so they draw alike; data-parallel replicas (other samples),
  pipeline stages (other layers) and any other axis draw independently. On CPU a random operator on a
  DTensor draws each local shard from this generator too (DTensor's offset-based RNG tracker is GPU-only).
- the accelerator's generators (CUDA): the rank's `pp` index only. On GPUs DTensor's random operators need
  one generator state on every rank of the SPMD mesh and draw each shard's slice of one global tensor (by
  offset), so that dropout on a DTensor draws what one device would; torch asks for one seed per pipeline
  stage. Plain (non-DTensor) draws on a GPU are therefore alike on every data-parallel replica, as in
  Megatron-LM's default.

Axes of size 1 do not count: a mesh `{"dp": 4, "tp": 1}` draws as `{"dp": 4}`, and one process as a mesh of
one. The order of the data is not drawn from these generators: `DistributedBatches` permutes the whole
dataset with a generator of its own, the same on every rank, whatever the mesh.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np
import torch

from loom.dist import env
from loom.dist.mesh import Mesh

__all__ = ["DEVICE_AXES", "SHARED_AXES", "StepSeeds", "check_seed", "seed"]

def check_seed(value: object, what: str = "loom.seed: n", *, allow_none: bool = False) -> int | None:
    """`value` as a seed (an int in [0, 2**64)); a clear TypeError or ValueError naming `what` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        none = ", or None not to seed" if allow_none else ""
        raise TypeError(
            f"{what} must be an int between 0 and 2**64 - 1{none}; got {value!r} ({type(value).__name__})"
        )
    if not 0 <= int(value) < 2**64:
        raise ValueError(f"{what} must be an int between 0 and 2**64 - 1; got {value}")
    return int(value)


def seed(n: int) -> None:
    """Seed torch (the CPU generator and every GPU's), Python's `random` and NumPy's legacy generator with `n`.

    Called with the same `n` on every rank, every rank then draws the same numbers: `torch.randn` gives the
    same "plain" tensor everywhere, as one process would. `loom.launch` calls it in every worker before the
    task (`seed=0` by default), and so does `loom run` before the script; under torchrun call it yourself
    after `loom.init()`. A `Trainer(seed=...)` reseeds every step per rank (see `StepSeeds`).
    """
    n = check_seed(n)
    torch.manual_seed(n)  # also every CUDA device's generator
    random.seed(n)
    # NumPy's legacy seed takes 32 bits; a larger seed goes in as two words.
    np.random.seed(n if n < 2**32 else [n & 0xFFFFFFFF, n >> 32])


# Axes whose peers compute on the same data: their CPU draws are alike.
SHARED_AXES = frozenset({"tp"})
# The only axes that tell the accelerator's generators apart (DTensor's random operators need the rest alike).
DEVICE_AXES = frozenset({"pp"})

Coordinates = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StepSeeds:
    """The generators of one rank: `seed` (the run's), and the rank's index on each mesh axis of size > 1."""

    seed: int
    coordinates: Coordinates = ()

    @classmethod
    def on_mesh(cls, seed: int, mesh: Mesh | None) -> StepSeeds:
        """This rank's seeds on `mesh`; without one, every process is a data-parallel replica of its own."""
        if mesh is None:
            return cls(seed, (("dp", env.rank()),) if env.world_size() > 1 else ())
        names = [name for name in mesh.shape.names if mesh.axis_size(name) > 1]
        return cls(seed, tuple((name, mesh.axis_rank(name)) for name in names))

    def host_seed(self, step: int, generator: str = "torch") -> int:
        """The seed of a host generator ("torch": the CPU one, "python", "numpy") for the step after `step`
        completed steps (each its own, so that Python and NumPy, both Mersenne twisters, do not repeat each
        other)."""
        counted = [(axis, index) for axis, index in self.coordinates if axis not in SHARED_AXES]
        return _fold(self.seed, step, generator, counted)

    def device_seed(self, step: int) -> int:
        """The seed of the accelerator's generators for the step after `step` completed steps."""
        counted = [(axis, index) for axis, index in self.coordinates if axis in DEVICE_AXES]
        return _fold(self.seed, step, "device", counted)

    def apply(self, step: int) -> None:
        """Seed every generator of this process for the step after `step` completed steps."""
        torch.manual_seed(self.host_seed(step))  # the CPU generator (and, until below, every device's)
        random.seed(self.host_seed(step, "python"))
        numpy = self.host_seed(step, "numpy")
        np.random.seed([numpy & 0xFFFFFFFF, numpy >> 32])  # the legacy generator takes 32-bit words
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(self.device_seed(step))


def _fold(seed: int, step: int, generator: str, coordinates: list[tuple[str, int]]) -> int:
    """A 63-bit seed from the run's seed, the step, the generator and the coordinates that count (in any
    order)."""
    where = ",".join(f"{axis}={index}" for axis, index in sorted(coordinates))
    digest = hashlib.sha256(f"loom-rng:{seed}:{step}:{generator}:{where}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63
