"""Gradient synchronisation across replicas: bucketed all-reduce overlapped with backward (as DDP does).

Each parameter's gradient is routed to a process group (the ranks holding replicas that computed parts of
it) with a scale (1/N to average in plain data parallelism, 1 for DTensor's pending sums). Gradients of one
route are packed into buckets of about `bucket_mb` megabytes, in the order backward produces them; a bucket's
all-reduce starts as soon as its last gradient is ready, while backward goes on; the end of backward waits
for all of them and writes the results back. Buckets start in one fixed order on every rank, as collectives
must.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from loom.dist._torch_private import queue_backward_callback
from loom.dist.collectives import reduce_scatter_flat


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
    buffer: torch.Tensor
    offsets: list[int]
    ready: set[int] = field(default_factory=set)
    work: dist.Work | None = None
    launched: bool = False
    shard_grad: torch.Tensor | None = None  # with sharded gradients: this rank's reduced chunk

    def __post_init__(self) -> None:
        self.index = {param: i for i, param in enumerate(self.params)}
        self.group_size = dist.get_world_size(self.route.group)
        self.group_rank = dist.get_rank(self.route.group)

    @property
    def numel(self) -> int:
        """Elements of the gradients (the buffer may be padded beyond, to split evenly)."""
        return self.offsets[-1]

    @property
    def chunk(self) -> int:
        """Elements each rank of the group owns when the bucket is split evenly (the last chunk padded)."""
        return -(-self.numel // self.group_size)

    def pack(self, param: nn.Parameter, local_grad: torch.Tensor) -> None:
        i = self.index[param]
        self.buffer[self.offsets[i] : self.offsets[i] + local_grad.numel()].copy_(local_grad.reshape(-1))
        self.ready.add(i)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch(self, scatter: bool = False) -> None:
        """All-reduce the buffer, or with `scatter` reduce-scatter it: each rank keeps its own chunk."""
        for i in set(range(len(self.params))) - self.ready:
            self.buffer[self.offsets[i] : self.offsets[i + 1]].zero_()  # unused this step
        if scatter:
            self.shard_grad = torch.empty(self.chunk, dtype=self.buffer.dtype, device=self.buffer.device)
            self.work = reduce_scatter_flat(
                self.shard_grad, self.buffer, group=self.route.group, async_op=True
            )
        else:
            self.work = dist.all_reduce(self.buffer[: self.numel], group=self.route.group, async_op=True)
        self.launched = True

    def wait_and_unpack(self) -> None:
        """Wait for the collective; scale; write full gradients back (not when only a chunk came back)."""
        assert self.work is not None
        self.work.wait()
        self.work = None
        if self.shard_grad is not None:
            self.shard_grad.mul_(self.route.scale)
            self.ready.clear()
            return
        if self.route.scale != 1:
            self.buffer.mul_(self.route.scale)
        for i in sorted(self.ready):
            param = self.params[i]
            chunk = self.buffer[self.offsets[i] : self.offsets[i + 1]]
            self.route.finish(param, chunk)
        self.ready.clear()


class GradSync:
    """Bucketed, overlapped gradient reduction for the parameters of a module.

    `route(param) -> (Route | None, local_grad)` says where each gradient goes (None: nothing to reduce).
    Buckets are learnt from the first backward pass (reduced at its end) and reused afterwards; when a
    gradient's route changes they are learnt again. Every rank runs the same program, so every rank learns
    the same buckets in the same order.
    """

    def __init__(
        self,
        module: nn.Module,
        route: Callable[[nn.Parameter], tuple[Route | None, torch.Tensor]],
        bucket_mb: float = 25.0,
        after_sync: Callable[[], None] | None = None,
    ) -> None:
        self.shard_gradients = False  # ZeRO level 2: reduce-scatter, keep only this rank's chunk
        self.unit_of: dict[nn.Parameter, int] = {}  # ZeRO level 3: buckets never span two units
        self.route = route
        self.after_sync = after_sync
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        self.enabled = True
        self._seen: list[tuple[nn.Parameter, Route]] = []  # gradients ready this pass, in order
        self._stale = False  # a gradient did not fit the buckets this pass: relearn them at its end
        self._next_launch = 0
        self._queued = False
        self.reduced_bytes = 0  # bytes all-reduced by the last backward pass (for tests and benchmarks)
        self.collectives = 0  # all-reduces issued by the last backward pass
        self.handles: list = []
        self.attach(module)

    def attach(self, module: nn.Module) -> None:
        """Hook the parameters `module` has now (again after `to_empty` replaced them); forget the buckets."""
        for handle in self.handles:
            handle.remove()
        self.params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self.buckets, self.bucket_of = [], {}

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (gradient accumulation); sync on a later backward."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        if not self._queued:
            self._queued = True
            queue_backward_callback(self._finish)
        route, local_grad = self.route(param)
        if route is None:
            return
        self._seen.append((param, route))
        bucket = self.bucket_of.get(param)
        if self._stale or bucket is None or bucket.route.key != route.key:
            self._stale = True
            return
        bucket.pack(param, local_grad)
        if self.shard_gradients:
            param.grad = None  # packed: the full gradient is no longer kept (ZeRO level 2)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self.buckets[self._next_launch].launch(self.shard_gradients)
            self._next_launch += 1

    def _finish(self) -> None:
        launched = self.buckets[: self._next_launch]
        if self._stale:
            if self.shard_gradients and launched:
                raise RuntimeError(
                    "a gradient's reduction group changed between steps while gradients are sharded "
                    "(optimizer level 2); keep the model's layouts fixed after the first step"
                )
            reduced = {p for bucket in launched for p in bucket.params}
            self._wait(launched)
            self._rebuild()
            for param, _ in self._seen:
                if param not in reduced:
                    self.bucket_of[param].pack(param, self.route(param)[1])
                    if self.shard_gradients:
                        param.grad = None
        for bucket in self.buckets[self._next_launch if not self._stale else 0 :]:
            if bucket.ready:
                bucket.launch(self.shard_gradients)
        self._wait(self.buckets)
        issued = [bucket for bucket in dict.fromkeys(launched + self.buckets) if bucket.launched]
        self.collectives = len(issued)
        self.reduced_bytes = sum(bucket.numel * bucket.buffer.element_size() for bucket in issued)
        for bucket in issued:
            bucket.launched = False
        self._seen, self._stale, self._next_launch, self._queued = [], False, 0, False
        if self.after_sync is not None:
            self.after_sync()

    @staticmethod
    def _wait(buckets: list[Bucket]) -> None:
        for bucket in buckets:
            if bucket.work is not None:
                bucket.wait_and_unpack()

    def _rebuild(self) -> None:
        """Buckets from this pass's gradients, in the order they became ready, one route and dtype each."""
        groups: list[list[tuple[nn.Parameter, Route, torch.Tensor]]] = []
        open_groups: dict[tuple, list] = {}
        for param, route in dict((p, (p, r)) for p, r in self._seen).values():
            grad = self.route(param)[1]
            key = (route.key, grad.dtype, self.unit_of.get(param))
            current = open_groups.get(key)
            if current is None or sum(g.numel() * g.element_size() for *_, g in current) >= self.bucket_bytes:
                current = open_groups[key] = []
                groups.append(current)
            current.append((param, route, grad))
        self.buckets, self.bucket_of = [], {}
        for items in groups:
            sizes = [g.numel() for *_, g in items]
            offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            size = dist.get_world_size(items[0][1].group)
            padded = -(-offsets[-1] // size) * size  # a multiple of the group size, to split evenly
            buffer = torch.zeros(padded, dtype=items[0][2].dtype, device=items[0][2].device)
            bucket = Bucket(route=items[0][1], params=[p for p, *_ in items], buffer=buffer, offsets=offsets)
            self.buckets.append(bucket)
            self.bucket_of.update((p, bucket) for p, *_ in items)

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self.handles:
            handle.remove()
