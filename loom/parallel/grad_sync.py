"""Gradient synchronisation across replicas: bucketed all-reduce overlapped with backward (as DDP does).

Each parameter's gradient is routed to a process group (the ranks holding replicas that computed parts of
it) with a scale (1/N to average in plain data parallelism, 1 for DTensor's pending sums). Gradients of one
route are packed into buckets of about `bucket_mb` megabytes, in the order backward produces them; a bucket's
all-reduce starts as soon as its last gradient is ready, while backward goes on. The end of backward reduces
every bucket not yet started (missing gradients count as zeros), so that every rank issues the same
collectives in the same order; a tiny all-reduce then tells every rank which parameters got a gradient on
some rank, and those get the reduced gradient everywhere (DDP's semantics for parameters a rank did not use).

Plain data parallelism knows every route up front, so its buckets are fixed from the start (parameters in
reverse order, roughly the order backward reaches them). DTensor routes are learnt from the first backward
pass (reduced at its end) and learnt again when a gradient stops fitting its bucket; every rank must then
produce the same gradients (a clear error otherwise). Bucket buffers live only while their collective runs.

A pipeline rank runs many backward passes a step (one per micro-batch and stage) and one `GradSync` serves all
of its stages: it is enabled only during each stage's last backward pass (`syncing`), a parameter that
several of its stages share is final after as many enabled passes (`final_passes`), and the caller ends the
reduction once the schedule is done (`auto_finish=False`, then `finish`). A pass that produces gradients
outside autograd's accumulation (a zero-bubble schedule's weight pass) reports them with `grad_ready`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from loom.cost.buckets import assign_buckets, bucket_bytes
from loom.dist._torch_private import queue_backward_callback
from loom.dist.collectives import reduce_scatter_flat
from loom.parallel.batch_check import BatchRows


@dataclass(frozen=True)
class Route:
    """Where a gradient is reduced: a process group, a scale applied afterwards, and a key naming both."""

    key: tuple
    group: dist.ProcessGroup | None
    scale: float
    finish: Callable[[nn.Parameter, torch.Tensor], None]  # writes the reduced local gradient back
    copies: int = 1  # ranks outside the group that hold the same values (replicas over other mesh dims)


@dataclass(eq=False)
class Bucket:
    """Gradients of one route packed into one flat buffer, reduced by one collective."""

    route: Route
    params: list[nn.Parameter]
    offsets: list[int]
    dtype: torch.dtype
    device: torch.device
    ready: set[int] = field(default_factory=set)
    buffer: torch.Tensor | None = None  # allocated by the first gradient of a pass, freed after reduction
    work: dist.Work | None = None
    launched: bool = False
    shard_grad: torch.Tensor | None = None  # with sharded gradients: this rank's reduced chunk

    def __post_init__(self) -> None:
        self.index = {param: i for i, param in enumerate(self.params)}
        self.group_size = dist.get_world_size(self.route.group)
        self.group_rank = dist.get_rank(self.route.group)

    @property
    def numel(self) -> int:
        """Elements of the gradients (the buffer is padded beyond, to split evenly)."""
        return self.offsets[-1]

    @property
    def chunk(self) -> int:
        """Elements each rank of the group owns when the bucket is split evenly (the last chunk padded)."""
        return -(-self.numel // self.group_size)

    def _buffer(self) -> torch.Tensor:
        if self.buffer is None:  # zeros: a gradient missing this pass counts as zero
            self.buffer = torch.zeros(self.chunk * self.group_size, dtype=self.dtype, device=self.device)
        return self.buffer

    def pack(self, param: nn.Parameter, local_grad: torch.Tensor) -> None:
        i = self.index[param]
        self._buffer()[self.offsets[i] : self.offsets[i] + local_grad.numel()].copy_(local_grad.reshape(-1))
        self.ready.add(i)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch(self, scatter: bool = False) -> None:
        """All-reduce the buffer, or with `scatter` reduce-scatter it: each rank keeps its own chunk."""
        buffer = self._buffer()
        if scatter:
            self.shard_grad = torch.empty(self.chunk, dtype=self.dtype, device=self.device)
            self.work = reduce_scatter_flat(self.shard_grad, buffer, group=self.route.group, async_op=True)
        else:
            self.work = dist.all_reduce(buffer[: self.numel], group=self.route.group, async_op=True)
        self.launched = True

    def wait_and_unpack(self, used: set[nn.Parameter]) -> None:
        """Wait for the collective, scale, and write the reduced gradients of the parameters that got one on
        some rank (`used`) back (a sharded bucket keeps only its chunk); free the buffer."""
        assert self.work is not None
        self.work.wait()
        self.work = None
        if self.shard_grad is not None:
            self.shard_grad.mul_(self.route.scale)
        else:
            buffer = self._buffer()
            if self.route.scale != 1:
                buffer.mul_(self.route.scale)
            for i, param in enumerate(self.params):
                if i in self.ready or param in used:
                    if param.grad is None:  # used on another rank only: it gets the average too
                        param.grad = torch.zeros_like(param)
                    self.route.finish(param, buffer[self.offsets[i] : self.offsets[i + 1]])
        self.ready.clear()
        self.buffer = None


class GradSync:
    """Bucketed, overlapped gradient reduction for the parameters of a module.

    `route(param) -> (Route | None, local_grad)` says where each gradient goes (None: nothing to reduce); a
    route function with a `static` attribute (`static(param) -> Route | None`) knows every route before
    backward. With `auto_finish` (the default) the reduction ends when the backward pass that started it ends;
    otherwise the caller ends it with `finish` (a pipeline, whose last backward passes are several).

    Usage agreement: every rank of `group` must call `finish` (or run its backward passes) together, in the
    same order, with the same routes; the buckets' collectives run on their routes' groups, in bucket order.
    """

    def __init__(
        self,
        module: nn.Module,
        route: Callable[[nn.Parameter], tuple[Route | None, torch.Tensor]],
        bucket_mb: float = 25.0,
        after_sync: Callable[[], None] | None = None,
        group: dist.ProcessGroup | None = None,
        auto_finish: bool = True,
    ) -> None:
        # the ranks that run `module` together (None: the world); their usage agreement never leaves them, so
        # that pipeline ranks, which hold other stages and are elsewhere in the schedule, take no part
        self.group = group
        self.shard_gradients = False  # ZeRO level 2: reduce-scatter, keep only this rank's chunk
        self.unit_of: dict[nn.Parameter, int] = {}  # ZeRO level 3: buckets never span two units
        # enabled passes that produce a parameter's final gradient (a table two pipeline stages share: 2)
        self.final_passes: dict[nn.Parameter, int] = {}
        self.route = route
        self.static: Callable[[nn.Parameter], Route | None] | None = getattr(route, "static", None)
        self.auto_finish = auto_finish
        self.after_sync = after_sync
        self.bucket_bytes = bucket_bytes(bucket_mb)
        self.enabled = True
        self.reduced_bytes = 0  # bytes reduced by the last backward pass (for tests and benchmarks)
        self.collectives = 0  # bucket collectives issued by the last backward pass
        self.handles: list = []
        # data parallelism: each forward's rows since the last sync, agreed on with the gradient flags
        self.batch_rows: BatchRows | None = None
        self.attach(module)

    def attach(self, module: nn.Module) -> None:
        """Hook the parameters `module` has now (again after materialisation replaced them)."""
        for handle in self.handles:
            handle.remove()
        self.params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self.handles = [p.register_post_accumulate_grad_hook(self.grad_ready) for p in self.params]
        self._reset_pass()
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        if self.static is not None:
            self.rebuild_static()

    def rebuild_static(self) -> None:
        """Fixed buckets for routes known up front: parameters in reverse order, grouped by route, unit and
        dtype."""
        assert self.static is not None
        routes = [(p, self.static(p)) for p in reversed(self.params)]
        self._make_buckets([(p, route, p) for p, route in routes if route is not None])

    def _reset_pass(self) -> None:
        self._seen: list[tuple[nn.Parameter, Route]] = []  # gradients ready this pass, in order
        self._leftover: list[nn.Parameter] = []  # gradients that fit no bucket this pass
        self._next_launch = 0
        self._queued = False
        self._arrivals: dict[nn.Parameter, int] = {}  # enabled passes seen so far, for `final_passes`

    def no_sync(self):
        """Accumulate gradients locally inside the block (gradient accumulation); sync on a later backward."""
        return self.syncing(False)

    @contextmanager
    def syncing(self, enabled: bool) -> Iterator[None]:
        """Inside the block, gradients that become ready are reduced (`enabled`) or only accumulated."""
        saved, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = saved

    def grad_ready(self, param: nn.Parameter) -> None:
        """`param`'s gradient is ready (autograd's accumulation hook, or a pass that wrote `.grad` itself):
        pack it once it is final, and launch the buckets completed in order."""
        if not self.enabled:
            return
        needed = self.final_passes.get(param, 1)
        if needed > 1:
            self._arrivals[param] = self._arrivals.get(param, 0) + 1
            if self._arrivals[param] < needed:
                return
        if self.auto_finish and not self._queued:
            self._queued = True
            queue_backward_callback(self._finish)
        self._take(param)

    def finish(self) -> None:
        """End the reduction (with `auto_finish=False`): launch the buckets not launched yet (missing
        gradients count as zeros), agree on which parameters got one, and write the reduced gradients."""
        self._finish()

    def _take(self, param: nn.Parameter) -> None:
        """Pack a ready gradient into its bucket, and launch the buckets completed in order."""
        route, local_grad = self.route(param)
        if route is None:
            return
        self._seen.append((param, route))
        bucket = self.bucket_of.get(param)
        if bucket is None or bucket.route.key != route.key:
            self._leftover.append(param)
            return
        bucket.pack(param, local_grad)
        if self.shard_gradients:
            param.grad = None  # packed: the full gradient is no longer kept (ZeRO level 2)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self.buckets[self._next_launch].launch(self.shard_gradients)
            self._next_launch += 1

    def _finish(self) -> None:
        for bucket in self.buckets[self._next_launch :]:  # every bucket, every pass, in the same order
            bucket.launch(self.shard_gradients)
        issued = list(self.buckets)
        used, leftover, uneven = self._agree()
        for bucket in self.buckets:
            bucket.wait_and_unpack(used)
        if leftover:
            issued += self._relearn(leftover)
        self.collectives = len(issued)
        self.reduced_bytes = sum(bucket.numel * bucket.dtype.itemsize for bucket in issued)
        self._reset_pass()
        if self.batch_rows is not None:
            if uneven:
                self.batch_rows.refuse(self.group, uneven)
            self.batch_rows.reset()
        if self.after_sync is not None:
            self.after_sync()

    def _agree(self) -> tuple[set[nn.Parameter], list[nn.Parameter], int]:
        """One small all-reduce: which parameters got a gradient, and which fit no bucket, on any rank; and
        (data parallelism) whether the ranks' forwards since the last sync had the same rows: if not, the
        most forwards a rank made (else 0)."""
        seen = {id(p) for p, _ in self._seen}  # ids: `in` on tensors would compare them elementwise
        leftover_here = {id(p) for p in self._leftover}
        n = len(self.params)
        rows = (
            self.batch_rows.vector() if self.batch_rows is not None else torch.zeros(0, dtype=torch.float64)
        )
        flags = torch.zeros(2, 2 * n + rows.numel(), dtype=torch.float64)
        for i, param in enumerate(self.params):
            flags[0, i] = float(id(param) in seen)
            flags[0, n + i] = float(id(param) in leftover_here)
        flags[0, 2 * n :] = rows
        flags[1] = -flags[0]
        # [0]: any rank; [1]: minus "every rank"
        if dist.get_world_size(self.group) > 1:  # alone (a pipeline stage of one rank), they are this rank's
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        largest, smallest = flags[0, 2 * n :], -flags[1, 2 * n :]
        uneven = int(largest[0]) if not torch.equal(largest, smallest) else 0
        flags = flags[:, : 2 * n].reshape(2, 2, n)
        anywhere, everywhere = flags[0], -flags[1]
        if self.static is None and not torch.equal(anywhere, everywhere):
            differ = [
                p for i, p in enumerate(self.params) if not torch.equal(anywhere[:, i], everywhere[:, i])
            ]
            names = ", ".join(
                f"parameter {i} {tuple(p.shape)}" for i, p in enumerate(self.params) if p in differ
            )
            raise RuntimeError(
                f"{names} got a gradient (or a reduction group) on some ranks but not on others; with "
                f"DTensor parameters every rank must run the same operators on every step"
            )
        used = {p for i, p in enumerate(self.params) if anywhere[0, i]}
        leftover = [p for i, p in enumerate(self.params) if anywhere[1, i]]
        return used, leftover, uneven

    def _relearn(self, leftover: list[nn.Parameter]) -> list[Bucket]:
        """Buckets learnt from this pass (in backward order); reduce the leftover gradients with them now."""
        if self.shard_gradients and self.buckets:
            raise RuntimeError(
                "a gradient's reduction group changed between steps while gradients are sharded "
                "(optimizer level 2 or 3); keep the model's layouts fixed after the first step"
            )
        self._make_buckets(
            [(p, r, self.route(p)[1]) for p, r in dict((p, (p, r)) for p, r in self._seen).values()]
        )
        ids = {id(p) for p in leftover}
        pending = [bucket for bucket in self.buckets if any(id(p) in ids for p in bucket.params)]
        for param in leftover:
            self.bucket_of[param].pack(param, self.route(param)[1])
            if self.shard_gradients:
                param.grad = None
        for bucket in pending:
            bucket.launch(self.shard_gradients)
        for bucket in pending:
            bucket.wait_and_unpack(set())
        return pending

    def _make_buckets(self, items: list[tuple[nn.Parameter, Route, torch.Tensor]]) -> None:
        """Group (parameter, route, gradient-like) items into buckets: one route, dtype and unit each, cut
        by `loom.cost.buckets.assign_buckets` (the rule the traffic prediction applies too)."""
        keyed = [
            ((route.key, like.dtype, self.unit_of.get(param)), like.numel() * like.element_size())
            for param, route, like in items
        ]
        self.buckets, self.bucket_of = [], {}
        for indices in assign_buckets(keyed, self.bucket_bytes):
            group = [items[i] for i in indices]
            sizes = [_local_numel(t) for *_, t in group]
            offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            like = group[0][2]
            bucket = Bucket(
                route=group[0][1], params=[p for p, *_ in group], offsets=offsets, dtype=like.dtype,
                device=like.device,
            )  # fmt: skip
            self.buckets.append(bucket)
            self.bucket_of.update((p, bucket) for p, *_ in group)

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()


def _local_numel(tensor: torch.Tensor) -> int:
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()
