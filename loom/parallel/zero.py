"""Optimizer parallelism (MindSpore's optimizer levels, ZeRO's stages 1 and 2), on loom's gradient buckets.

Every gradient bucket is split evenly over the ranks that reduce it (its data-parallel replicas): each rank
keeps an fp32 copy of its chunk of the bucket's parameters and runs the optimizer on that chunk alone, so the
optimizer states are sharded (level 1). At level 2 the bucket is reduce-scattered instead of all-reduced, so
each rank also keeps only its chunk of the gradients (the full gradients are dropped as soon as they are
packed). After the update, one all-gather per bucket brings every rank the new parameters.

This composes with tensor parallelism: a bucket holds a rank's local shards of DTensor parameters, and its
group is the data-parallel group that shares them. Parameters whose gradients need no reduction are updated
whole, by a second optimizer of the same kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.dist.collectives import all_gather_flat
from loom.dist.local import local_tensor
from loom.parallel.grad_sync import Bucket, GradSync
from loom.parallel.grads import GradView, grad_views
from loom.parallel.zero3 import ParameterSharding, model_units
from loom.plan import OPTIMIZER_LEVELS as LEVELS

if TYPE_CHECKING:
    from loom.parallel.pipeline.schedule import Pipeline


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the same memory with its own version counter: writing parameters through it does not
    invalidate what autograd saved of them (at level 3 backward refills the storage it saved)."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


class BucketShard:
    """This rank's chunk of one bucket: fp32 parameters the optimizer updates, and how to publish them."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        start = bucket.group_rank * bucket.chunk
        self.pieces = []  # (param, first element in param, last, first element in master)
        for param, offset, end in zip(bucket.params, bucket.offsets, bucket.offsets[1:], strict=False):
            lo, hi = max(offset, start), min(end, start + bucket.chunk)
            if lo < hi:
                self.pieces.append((param, lo - offset, hi - offset, lo - start))
        with torch.no_grad():
            self.master = self.cut(lambda param: param)

    def cut(
        self, values: Callable[[nn.Parameter], torch.Tensor | None], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """This rank's chunk of one tensor per parameter of the bucket (`values(param)`, shaped like the
        parameter's local shard; None reads as zeros), in the bucket's order; the padding is zero."""
        # on the bucket's device: the optimizer steps there, and NCCL gathers only device tensors
        chunk = torch.zeros(self.bucket.chunk, dtype=dtype, device=self.bucket.device)
        for param, lo, hi, at in self.pieces:
            value = values(param)
            if value is not None:
                chunk[at : at + hi - lo].copy_(local_tensor(value).reshape(-1)[lo:hi])
        return chunk

    def gather(self, chunk: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Every rank's `chunk` of the bucket, all-gathered (collective over the bucket's group), as each
        parameter's flat local elements (views of one buffer that lives as long as they do)."""
        bucket = self.bucket
        gathered = torch.empty(bucket.chunk * bucket.group_size, dtype=chunk.dtype, device=chunk.device)
        all_gather_flat(gathered, chunk.contiguous(), group=bucket.route.group)
        return [
            (param, gathered[offset:end])
            for param, offset, end in zip(bucket.params, bucket.offsets, bucket.offsets[1:], strict=False)
        ]

    def load_full_grads(self) -> None:
        """Level 1: this rank's chunk of the all-reduced gradients."""
        self.master.grad = self.cut(lambda param: param.grad)

    def load_shard_grad(self) -> None:
        """Level 2: the chunk the reduce-scatter left on this rank."""
        shard = self.bucket.shard_grad
        self.master.grad = None if shard is None else shard.to(torch.float32)

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather the updated chunks and write the parameters of the bucket."""
        for param, flat in self.gather(self.master):
            local = local_tensor(param)
            _alias(local).copy_(flat.view_as(local))


class ZeroOptimizer(torch.optim.Optimizer):
    """`optimizer_class` (e.g. `torch.optim.AdamW`) with its states sharded over data-parallel replicas.

    Holds the model's parameters in `param_groups` (so learning-rate schedulers work as usual) and builds the
    sharded optimizer at the first step, when the gradient buckets are known. The buckets are those of the
    model's `GradSync` (`model.loom.grad_sync`), or of `grad_sync` when given (a pipeline's stages: see
    `loom.parallel.pipeline.optimizer`, which at level 3 also gives the stages' `sharding`). At level 3 `units` are
    the modules gathered one at a time (default: `loom.parallel.zero3.model_units`, from the model's recipe).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        level: int = 1,
        *,
        grad_sync: GradSync | None = None,
        sharding: ParameterSharding | None = None,
        units: list[nn.Module] | None = None,
        **hyper,
    ) -> None:
        if level not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer takes level 1, 2 or 3, got {level} (level 0: a plain optimizer)")
        state = getattr(model, "loom", None)
        if state is None and grad_sync is None:
            raise ValueError("ZeroOptimizer needs a model made parallel by loom.parallelize")
        if (sharding is not None) != (level == 3 and grad_sync is not None):
            raise ValueError(
                "ZeroOptimizer: a module with its own grad_sync (a pipeline's stages) shards its parameters at "
                "level 3 with its own ParameterSharding (`sharding`), and only at level 3"
            )
        params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        super().__init__(params, hyper)
        self.sync = grad_sync if grad_sync is not None else state.grad_sync
        self.sync.shard_gradients = level >= 2
        self.level, self.optimizer_class, self.hyper = level, optimizer_class, hyper
        if sharding is None and level == 3:
            sharding = ParameterSharding(model, self.sync, units or model_units(model))
        self.sharding = sharding
        if state is not None:
            state.parameter_sharding = self.sharding
        self._on_build: list[Callable[[], None]] = []
        self.shards: list[BucketShard] = []
        self.whole: list[nn.Parameter] = []
        self.inner: list[torch.optim.Optimizer] = []
        self._buckets: list[Bucket] = []

    def _build(self) -> None:
        self._buckets = list(self.sync.buckets)
        self.shards = [BucketShard(bucket) for bucket in self._buckets]
        self.whole = self._unbucketed()
        self.inner = []
        if self.shards:
            self.inner.append(self.optimizer_class([shard.master for shard in self.shards], **self.hyper))
        if self.whole:
            self.inner.append(self.optimizer_class(self.whole, **self.hyper))
        for callback in self._on_build:  # e.g. a checkpoint's states, loaded once the chunks exist
            callback()
        self._on_build.clear()

    def on_build(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the sharded states exist (they are built at the first step, when the
        gradient buckets are known); at once if they already do."""
        if self.inner:
            callback()
        else:
            self._on_build.append(callback)

    def grad_views(self) -> list[GradView]:
        """The step's gradients as this rank holds them: at level 2, its bucket chunks."""
        if self.level == 1:
            return grad_views(self.param_groups[0]["params"])
        chunks = [
            GradView(bucket.shard_grad, bucket.route.copies)
            for bucket in self.sync.buckets
            if bucket.shard_grad is not None
        ]
        return chunks + grad_views(self._unbucketed())

    def held_tensors(self) -> list[torch.Tensor] | None:
        """What this rank updates, as it holds it: its fp32 chunk of every gradient bucket (one view of it
        per parameter piece), then the local tensors of the parameters updated whole (replicas stepping
        alone, `loom.parallel.local_sgd`, run their outer step on them; `republish` then makes the
        parameters follow). Builds the chunks now if the first step has not yet; None while the buckets are
        unknown (routes learnt by the first backward)."""
        if not self.inner:
            if not self.sync.buckets:
                return None
            self._build()
        pieces = [shard.master[at : at + hi - lo] for shard in self.shards for _, lo, hi, at in shard.pieces]
        return pieces + [local_tensor(p) for p in self.whole]

    def gathered_parameters(self) -> contextlib.AbstractContextManager:
        """The parameters whole on this rank inside the block (level 3, once they live in the chunks: gathered
        by every rank of their buckets' groups together, freed after); elsewhere they are already."""
        if self.sharding is not None and self.sharding.active:
            return self.sharding.full_parameters()
        return contextlib.nullcontext()

    @torch.no_grad()
    def republish(self) -> None:
        """The parameters after `held_tensors` were written from outside: every rank's chunks all-gathered
        into them (collective over each bucket's group); at level 3 once the chunks hold the parameters,
        each unit is gathered afresh at its next use instead."""
        if self.sharding is not None and self.sharding.active:
            self.sharding.gathered = [False] * len(self.sharding.units)
            return
        for shard in self.shards:
            shard.publish()

    @torch.no_grad()
    def recut(self) -> None:
        """The chunks copied again from the parameters: weights loaded into them after the chunks were built
        (before level 3's first step, while the parameters still hold memory)."""
        if self.sharding is not None and self.sharding.active:
            raise ValueError("ZeroOptimizer.recut: at level 3 the chunks hold the parameters already")
        for shard in self.shards:
            shard.master.copy_(shard.cut(lambda param: param))

    def whole_params(self) -> list[nn.Parameter]:
        """The parameters in no gradient bucket (updated whole): their gradients are kept whole."""
        return self._unbucketed()

    def _unbucketed(self) -> list[nn.Parameter]:
        in_buckets = {param for bucket in self.sync.buckets for param in bucket.params}
        return [p for p in self.param_groups[0]["params"] if p not in in_buckets]

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        if len(self.param_groups) != 1:
            raise ValueError("ZeroOptimizer supports one parameter group")
        if not self.inner:
            self._build()
        elif self.sync.buckets != self._buckets:
            raise RuntimeError(
                "gradient buckets changed after the first step; optimizer states would be lost"
            )
        for shard in self.shards:
            shard.load_full_grads() if self.level == 1 else shard.load_shard_grad()
        settings = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        for optimizer in self.inner:
            optimizer.param_groups[0].update(settings)
            optimizer.step()
        for shard in self.shards:
            shard.master.grad = None
        if self.sharding is None:
            for shard in self.shards:
                shard.publish()
        elif not self.sharding.active:
            self.sharding.attach_shards(self.shards)  # parameters live in the chunks from now on
        else:
            for index in range(len(self.sharding.units)):
                self.sharding.gathered[index] = False  # stale: the next use gathers the new values

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for bucket in self.sync.buckets:
            bucket.shard_grad = None

    def state_dict(self) -> dict:
        """This rank's sharded states (rank-local; `loom.checkpoint` saves and restores them with the plan),
        with the cut of its chunks (`chunks`: per bucket its chunk size, this rank's place and the group size)."""
        return {
            "level": self.level,
            "chunks": self._chunk_layout(),
            "inner": [optimizer.state_dict() for optimizer in self.inner],
        }

    def _chunk_layout(self) -> list[list[int]]:
        return [[s.bucket.chunk, s.bucket.group_rank, s.bucket.group_size] for s in self.shards]

    def load_state_dict(self, state_dict: dict) -> None:
        """This rank's `state_dict()` back, once the chunks are built (`held_tensors`) and cut as they were
        when it was saved (the same mesh: replicas stepping alone resume so). Otherwise not supported: the
        states belong to bucket chunks that exist only after the first step; resume with
        `loom.checkpoint.load_checkpoint`, which restores them when the chunks are built."""
        if (
            self.inner
            and state_dict.get("level") == self.level
            and len(state_dict["inner"]) == len(self.inner)
        ):
            saved = state_dict.get("chunks")
            if saved is not None and saved != self._chunk_layout():  # None: saved before states said
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: the state's chunks (size, rank, group size per bucket) "
                    f"{saved} are not this rank's {self._chunk_layout()}: it was saved by another rank or with "
                    "other buckets (bucket_mb, mesh); load it on the rank and layout that saved it, or use "
                    "loom.checkpoint.load_checkpoint, which reshards"
                )
            for optimizer, state in zip(self.inner, state_dict["inner"], strict=True):
                optimizer.load_state_dict(state)
            return
        raise NotImplementedError(
            "ZeroOptimizer.load_state_dict: use loom.checkpoint.load_checkpoint (or Checkpointer.resume), "
            "which restores sharded states once the gradient buckets exist"
        )


def make_optimizer(
    model: nn.Module | Pipeline,
    optimizer_class: Callable[..., torch.optim.Optimizer],
    level: int = 0,
    *,
    units: list[nn.Module] | None = None,
    **hyper,
) -> torch.optim.Optimizer:
    """The optimizer of a run's model parts at optimizer level `level`, the one builder for every run.

    `model`: one module (0: `optimizer_class` itself; 1, 2: sharded states and gradients; 3: also
    parameters, gathered around each of `units`, by default `loom.parallel.zero3.model_units(model)`), or
    this rank's pipeline stages, a `loom.parallel.pipeline.Pipeline` (states sharded over the ranks that run
    the same stages, on the buckets in which the pipeline reduces their gradients; level 3 gathers each stage
    inside the schedule; see `loom.parallel.pipeline.optimizer`)."""
    if level not in LEVELS:
        raise ValueError(f"optimizer level {level}; loom supports {LEVELS}")
    # imported here: the pipeline modules build on this one
    from loom.parallel.pipeline.optimizer import stages_optimizer
    from loom.parallel.pipeline.schedule import Pipeline

    if isinstance(model, Pipeline):
        if units is not None:
            raise ValueError("make_optimizer: a pipeline's level 3 gathers its stages; give no units")
        return stages_optimizer(model, optimizer_class, level, **hyper)
    if units is not None and level != 3:
        raise ValueError(f"make_optimizer: units are the modules level 3 gathers; level {level} has none")
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    return (
        optimizer_class(params, **hyper)
        if level == 0
        else ZeroOptimizer(model, optimizer_class, level, units=units, **hyper)
    )
