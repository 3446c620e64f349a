"""Optimizer level 3 (ZeRO stage 3): parameters sharded at rest, gathered per unit when needed.

The model is cut into units (`model_units`): each block of its block list, each module its recipe puts
before or after the blocks (embeddings, final norm, head; see `loom.models.recipes`), and the root for the
parameters left over; a model without a recipe: each block of every `nn.ModuleList`, and the root. A unit
may be any module its parent calls (hooks on its own forward gather and free it). Gradient buckets never span
two units. Between uses a unit's parameters hold no memory (their storage is resized to zero; each rank
keeps only its fp32 chunk in the optimizer). A unit is gathered (one all-gather per bucket) just before its
forward, freed after it, gathered again when backward reaches it (a hook on its outputs' gradients) and
freed once all its gradients are ready. Autograd's saved tensors point at the same storage, which is
refilled before it is read, as in FSDP.

Resizing needs storage that nobody else pins: a NumPy view (`.numpy()`) of a parameter makes its storage
non-resizable for good, so gathering or freeing its unit raises a `ValueError` that names the parameter and
says how to take a copy instead (checked before any resize: the unit stays as it was).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from loom.dist.local import local_tensor
from loom.models.recipes import Recipe, known_recipe, piece, submodule
from loom.parallel.grad_sync import GradSync


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every element of every `nn.ModuleList` in `model` (its layers), then the model itself."""
    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    return blocks + [model]


def model_units(model: nn.Module, recipe: Recipe | None = None) -> list[nn.Module]:
    """The units of `model` at level 3: with its `recipe` (by default the one of its class, if loom has one),
    each block, then each module the recipe puts before or after the blocks, then the model itself; else
    `default_units`.

    Only modules are units (a parameter a recipe names directly stays in the root). A module whose
    parameters another unit also uses (a head tied to the embedding table) is no unit of its own: a unit's
    parameters are freed after its forward, while the other user still needs them. Such modules stay in the
    root unit, gathered through the model's whole forward."""
    recipe = recipe or known_recipe(model)
    if recipe is None:
        return default_units(model)
    blocks = list(submodule(model, recipe.blocks, recipe.family))
    paths = dict.fromkeys((*recipe.before, *recipe.after))
    ends = [m for m in (piece(model, path, recipe.family) for path in paths) if isinstance(m, nn.Module)]
    uses: dict[nn.Parameter, int] = {}
    for unit in blocks + ends:
        for param in dict.fromkeys(unit.parameters()):
            uses[param] = uses.get(param, 0) + 1
    alone = [
        m for m in ends if any(True for _ in m.parameters()) and all(uses[p] == 1 for p in m.parameters())
    ]
    return blocks + alone + [model]


class ParameterSharding:
    """Gathers and frees the parameters of each unit around its forward and backward (with `hooks`; else
    where the caller says, `gathering`)."""

    def __init__(
        self, model: nn.Module, sync: GradSync, units: list[nn.Module] | None = None, *, hooks: bool = True
    ) -> None:
        self.units = units or default_units(model)
        self.names = {id(p): name for name, p in model.named_parameters()}  # for error messages
        self.params: list[list[nn.Parameter]] = []
        claimed: set[nn.Parameter] = set()
        for unit in self.units:
            own = [p for p in dict.fromkeys(unit.parameters()) if p.requires_grad and p not in claimed]
            claimed.update(own)
            self.params.append(own)
        sync.unit_of = {p: i for i, own in enumerate(self.params) for p in own}
        if sync.static is not None:
            sync.rebuild_static()  # fixed buckets must not span two units either
        self.shards: dict[int, list] = {}  # unit -> its BucketShards, set by the optimizer
        self.active = False  # True once the optimizer holds the parameters (after its first step)
        self.gathered = [True] * len(self.units)
        self.in_backward = [False] * len(self.units)
        self.pending = [0] * len(self.units)
        if hooks:
            self._install_hooks()

    def _install_hooks(self) -> None:
        for index, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda _m, _a, i=index: self._before_forward(i))
            unit.register_forward_hook(lambda _m, _a, out, i=index: self._after_forward(i, out))
            for param in self.params[index]:
                param.register_post_accumulate_grad_hook(lambda _p, i=index: self._grad_ready(i))

    def attach_shards(self, shards: list) -> None:
        """The optimizer's bucket chunks, grouped by unit; from now on parameters are sharded at rest."""
        unit_of = {id(p): i for i, own in enumerate(self.params) for p in own}
        self.shards = {}
        for shard in shards:
            self.shards.setdefault(unit_of[id(shard.bucket.params[0])], []).append(shard)
        self.active = True
        for index in range(len(self.units)):
            self.free(index)

    def gather(self, index: int) -> None:
        """Refill unit `index`'s parameters from every rank's chunk (one all-gather per bucket)."""
        if not self.active or self.gathered[index]:
            return
        self._require_resizable(index, "gather")
        for shard in self.shards.get(index, []):
            for param in shard.bucket.params:
                _storage(param).resize_(local_tensor(param).numel() * local_tensor(param).element_size())
            shard.publish()
        self.gathered[index] = True

    def free(self, index: int) -> None:
        """Release unit `index`'s parameter memory (only bucketed parameters: the others are not sharded)."""
        if not self.active or not self.gathered[index]:
            return
        self._require_resizable(index, "release")
        for shard in self.shards.get(index, []):
            for param in shard.bucket.params:
                _storage(param).resize_(0)
        self.gathered[index] = False

    @contextmanager
    def gathering(self, indices: Sequence[int]) -> Iterator[None]:
        """Units `indices` gathered inside the block (in that order: a collective per bucket, so every rank
        of their groups gathers the same units in the same order), freed again afterwards."""
        for index in indices:
            self.gather(index)
        try:
            yield
        finally:
            self._free_each(indices)

    def _free_each(self, indices: Sequence[int]) -> None:
        """Free units `indices`; a unit that cannot be freed (see `_require_resizable`) does not keep the
        others gathered: its error is raised once all the others are freed."""
        errors = []
        for index in indices:
            try:
                self.free(index)
            except ValueError as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def _require_resizable(self, index: int, action: str) -> None:
        """A `ValueError` when a parameter of unit `index` has storage that cannot be resized: a NumPy array
        shares it (torch pins the size of storage that `.numpy()` exposes, so that the array stays valid)."""
        for shard in self.shards.get(index, []):
            for param in shard.bucket.params:
                if not _storage(param).resizable():
                    name = self.names.get(id(param))
                    label = repr(name) if name else f"of shape {tuple(param.shape)}"
                    raise ValueError(
                        f"optimizer level 3 cannot {action} parameter {label}: its memory is shared with "
                        "a NumPy array (made by `.numpy()`), which pins the size of that memory. Between "
                        "uses a level-3 parameter holds no memory, so take a copy instead: "
                        "`param.detach().clone().numpy()` for this rank's shard, or "
                        "`loom.full(param).detach().clone().numpy()` inside "
                        "`with model.loom.full_parameters():` for the whole tensor"
                    )

    def full_parameters(self):
        """All parameters gathered inside the block (to read or save them); freed again afterwards."""
        return self.gathering(range(len(self.units)))

    def _before_forward(self, index: int) -> None:
        self.pending[index] = len(self.params[index])
        self.gather(index)

    def _after_forward(self, index: int, output: object) -> None:
        if self.in_backward[index] or not torch.is_grad_enabled():
            if not torch.is_grad_enabled() and not self.in_backward[index]:
                self.free(index)  # evaluation: no backward will need the parameters
            return
        self.free(index)
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, i=index: self._before_backward(i, grad))

    def _before_backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        self.in_backward[index] = True
        self.gather(index)
        return grad

    def _grad_ready(self, index: int) -> None:
        self.pending[index] -= 1
        if self.pending[index] == 0 and self.in_backward[index]:
            self.in_backward[index] = False
            self.free(index)


def _storage(param: torch.Tensor) -> torch.UntypedStorage:
    return local_tensor(param).untyped_storage()
