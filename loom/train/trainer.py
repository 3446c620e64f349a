"""`loom.Trainer`: the training loop, readable top to bottom.

One step: seed the random generators for the step (with a `seed`: see `loom.dist.rng`); split the rank's
batch into micro-batches; for each, forward under autocast and backward of the
(scaled) loss, letting gradients synchronise only on the last one; then, on the whole step's gradients
(`_update`): check finiteness (fp16), unscale, skip a step whose loss or gradient norm is not finite, clip to
a global norm taken across every shard and rank, update (unless skipped) and move the experts' balancing
biases, adjust the loss scale and the learning rate, and tell the callbacks. A run is a list of model parts:
one module, or this rank's pipeline stages (a `Pipeline`, whose schedule runs the first half);
`loom.train.steps` holds the first half for each.

The step computes on the device of the model's parameters (its batches are moved there) and waits for
nothing from it: the loss, the gradient norm and the finiteness check stay device tensors, clipping scales
by a device coefficient, and with a fused torch optimizer that reads `found_inf` (after its first step) the
skip of a non-finite step is that flag. The step's `StepMetrics` copy them to the host without waiting and
read them (one synchronisation) when something reads a metric: a logger at `log_every`, a callback. Where
the host must decide (fp16's loss scale, another optimizer, an optimizer's first step, replicas that count
skipped steps, experts' balancing biases) it reads the one flag it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.dist import env
from loom.dist.context import current_mesh
from loom.dist.mesh import Mesh
from loom.dist.rng import StepSeeds
from loom.models.moe import moe_layers, update_biases
from loom.parallel.grads import GradView, all_finite, clip_grads_, global_grad_norm, scale_grads_
from loom.parallel.local_sgd import Replicated
from loom.parallel.pipeline import Pipeline
from loom.parallel.zero import ZeroOptimizer
from loom.train.device import model_device
from loom.train.metrics import StepMetrics, mfu, peak_memory_bytes
from loom.train.precision import DynamicLossScaler, autocast
from loom.train.steps import global_mean, steps_for

__all__ = ["Trainer", "global_mean"]


class Trainer:
    """Trains a model made parallel by `loom.parallelize` (or a plain one), or this rank's pipeline stages
    (a `loom.parallel.pipeline.Pipeline`), with an optimizer (`loom.parallel.make_optimizer` builds it for
    either).

    A model's forward takes one micro-batch (a tuple of tensors) and returns the mean loss over it; a
    pipeline's micro-batches are `(inputs, targets)` pairs that it cuts again into its own. `named_as` is
    what `trainer.model` shows (checkpoints save its `state_dict`), by default the model or the stages;
    `loom.parallel.pipeline.stage_parameters` gives stages the whole model's names.
    `grad_accum` micro-batches make a step; `clip_grad_norm` clips the global gradient norm; `precision`
    is "fp32", "bf16" or "fp16" (with dynamic loss scaling). Each step returns `StepMetrics`; with
    `tokens_per_step` (the global batch's tokens) they include throughput, and with `flops_per_token` and
    `peak_flops` (per device) the model FLOPs utilisation. With `skip_nonfinite` (the default) a step whose
    loss or gradient norm is not finite changes nothing (`StepMetrics.skipped`; in fp16 the loss scaler's
    overflow check does the same). With `seed`, each step starts by seeding every random generator from the
    seed, the step and this rank's position on `mesh` (default: the model's mesh, else the current one; see
    `loom.dist.rng`), so that a resumed run, on any mesh, draws what a fresh run on that mesh would.
    `group` is the ranks that train one model together (default: every rank): the step's loss, gradient
    norm and finiteness are taken over them. Replicas that step alone and meet every few steps (an
    optimizer of `loom.parallel.local_sgd`) name their own ranks, so that a step between two syncs never
    talks to another replica; a step they skip (not finite) still counts towards their meetings.
    Callbacks (see `loom.train.metrics.Callback`) get `on_train_begin(trainer)`, `on_step_end(trainer,
    metrics)`, `on_eval_end(trainer, {"loss": ...})` and `on_train_end(trainer)`: the hook points for logging
    and checkpoints.
    """

    def __init__(
        self,
        model: nn.Module | Pipeline,
        optimizer: torch.optim.Optimizer,
        *,
        named_as: nn.Module | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        grad_accum: int = 1,
        clip_grad_norm: float | None = None,
        precision: str = "fp32",
        loss_scaler: DynamicLossScaler | None = None,
        callbacks: Sequence[object] = (),
        tokens_per_step: int = 0,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        skip_nonfinite: bool = True,
        seed: int | None = None,
        mesh: Mesh | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum {grad_accum} must be >= 1")
        if clip_grad_norm is not None and clip_grad_norm <= 0:
            raise ValueError(f"clip_grad_norm {clip_grad_norm} must be > 0 (or None for no clipping)")
        # how this kind of model parts runs a step's forward and backward, on the ranks of `group`
        self.steps = steps_for(model, group)
        self.model = named_as if named_as is not None else self.steps.module
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.grad_accum, self.clip_grad_norm, self.precision = grad_accum, clip_grad_norm, precision
        self.scaler = loss_scaler or (DynamicLossScaler() if precision == "fp16" else None)
        self.callbacks = list(callbacks)
        self.params = [p for p in dict.fromkeys(self.model.parameters()) if p.requires_grad]
        self.tokens_per_step, self.flops_per_token, self.peak_flops = (
            tokens_per_step,
            flops_per_token,
            peak_flops,
        )
        self.skip_nonfinite = skip_nonfinite
        self.group = group
        self.rng = None if seed is None else StepSeeds.on_mesh(seed, mesh or _mesh_of(self.model))
        self.step = 0
        self.is_main = env.rank() == 0
        self.device = model_device(self.model)  # where the step computes: its batches go there
        self._stepped = False  # whether the optimizer took a step the host decided (see _device_skippers)
        autocast(precision)  # validates the name now rather than at the first step

    def train_step(self, micro_batches: Sequence[tuple]) -> StepMetrics:
        """One optimizer step over `micro_batches` (this rank's parts of the global batch, moved to the
        model's device here). The step waits for no result of the device (see the module's docstring):
        its metrics are read when something reads them."""
        clock = StepClock(self.device)
        if self.rng is not None:  # what the step draws depends on the seed, the step and the rank alone
            self.rng.apply(self.step)
        loss = self._forward_backward([self._on_device(batch) for batch in micro_batches])
        return self._update(loss, clock)

    def _on_device(self, batch: tuple) -> tuple:
        """`batch`'s tensors on the model's device (from pinned memory on a GPU: a copy from pageable
        memory would wait for the device)."""
        device = self.device

        def move(value: object) -> object:
            if not isinstance(value, torch.Tensor) or value.device == device:
                return value
            if device.type == "cuda" and value.device.type == "cpu":
                value = value.contiguous().pin_memory()  # pin_memory refuses some non-contiguous views
            return value.to(device, non_blocking=True)

        return tuple(move(value) for value in batch)

    def _forward_backward(self, micro_batches: Sequence[tuple]) -> torch.Tensor | float:
        """Accumulate the (scaled) gradients of the step's mean loss; returns that loss, global."""
        return self.steps.forward_backward(self, micro_batches)

    def _update(self, loss: torch.Tensor | float, clock: StepClock) -> StepMetrics:
        """The rest of a step, on the accumulated gradients: unscale, check, clip, update (or skip), adjust
        the loss scale and the learning rate, report to the callbacks.

        The non-finite check stays on the device when the optimizer can skip on a device flag (torch's
        fused optimizers read `found_inf`); otherwise (and for fp16's loss scale, which the host adjusts)
        the host reads the flag: one synchronisation."""
        views = self._grad_views()
        finite = all_finite(views, self.group, self.device) if self.scaler else True
        if self.scaler:
            scale_grads_(views, 1.0 / self.scaler.scale)
        if finite:
            norm = global_grad_norm(views, self.group, self.device)
        else:
            norm = torch.full((), float("nan"), device=self.device)
        if not isinstance(loss, torch.Tensor):  # a pipeline's loss, read already
            loss = torch.full((), loss, dtype=torch.float32, device=norm.device)
        # the loss and the norm are global: every rank decides alike
        ok = torch.isfinite(loss).logical_and(torch.isfinite(norm)) if self.skip_nonfinite else None
        # fp16's loss scaler grows or backs off on the host, after the step it must know was taken
        skippers = self._device_skippers() if ok is not None and finite and not self.scaler else None
        if ok is not None and skippers is None:
            finite = finite and bool(ok)  # the host decides: one device synchronisation
        if self.clip_grad_norm is not None and finite:
            clip_grads_(views, self.clip_grad_norm, norm)
        if finite and skippers is not None:
            _step_unless(self.optimizer, skippers, ok.logical_not().float())
        elif finite:
            self.optimizer.step()
            self._stepped = True  # its state exists now: later steps may skip on the device
            # the experts' balancing biases, from the loads of every rank's tokens
            update_biases(self.steps.module, self.steps.balance_group())
        elif isinstance(self.optimizer, Replicated):
            self.optimizer.skip()  # the replicas still meet at the steps they all count
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler:
            self.scaler.update(finite)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step += 1
        # filled on the device: a tensor copied there from the host would wait for the device
        skipped = ok.logical_not() if skippers is not None else torch.full((), not finite, device=self.device)
        metrics = self._metrics(loss, norm, lr, skipped, clock.stop())
        self._call("on_step_end", self, metrics)
        metrics.release_device_flag()  # kept unread (a list of a run's steps), they hold no device memory
        return metrics

    def _device_skippers(self) -> list[torch.optim.Optimizer] | None:
        """The torch optimizers that can skip this step on a device flag (`found_inf`, which the fused
        kernels of `FOUND_INF_READERS` read), or None when the host must decide: another optimizer,
        replicas that count their skipped steps, experts' balancing biases (moved after a step that was
        taken), or an optimizer that has not taken a step yet. A first step builds the state (a sharding
        optimizer its inner optimizers): torch's fused SGD fills its momentum buffers with `empty_like`
        before a kernel that returns at once on `found_inf`, so a first step skipped there would leave
        garbage for the next."""
        optimizer = self.optimizer
        if not self._stepped or isinstance(optimizer, Replicated) or _balances_by_bias(self.steps.module):
            return None
        inner = optimizer.inner if isinstance(optimizer, ZeroOptimizer) else [optimizer]
        if not inner or not all(_skips_on_found_inf(o) for o in inner):
            return None
        return list(inner)

    def _metrics(
        self, loss: torch.Tensor, norm: torch.Tensor, lr: float, skipped: torch.Tensor, seconds: Callable
    ) -> StepMetrics:
        """The step's metrics, its device values read (one synchronisation) when first read. What they
        are computed with (tokens, FLOPs, peak, world size) is taken now: a read after the run (its process
        group gone) gives the step's figures."""
        device = norm.device
        values = torch.stack([loss.float().to(device), norm.float(), skipped.float().to(device)])
        values, ready = _to_host(values)
        tokens, flops, peak = self.tokens_per_step, self.flops_per_token, self.peak_flops
        world = env.world_size()

        def settle() -> dict:
            if ready is not None:
                ready.synchronize()  # the copy of the three values, and the step's end event before it
            loss_value, norm_value, skipped_value = values.tolist()
            step_time = seconds()
            rate = tokens / step_time if step_time > 0 else 0.0
            utilisation = mfu(rate, flops, peak, world) if flops and peak else None
            return dict(
                loss=loss_value, grad_norm=norm_value, skipped=bool(skipped_value), step_time_s=step_time,
                tokens_per_s=rate, mfu=utilisation,
            )  # fmt: skip

        return StepMetrics.deferred(
            settle, step=self.step, lr=lr, tokens=tokens, skipped_on_device=skipped,
            arrived=ready.query if ready is not None else None,
            peak_memory_bytes=peak_memory_bytes(self.device),
            loss_scale=self.scaler.scale if self.scaler else None,
        )  # fmt: skip

    def fit(
        self,
        batches: Iterator[Sequence[tuple]],
        steps: int,
        eval_every: int = 0,
        eval_batches: Callable[[], Iterable[tuple]] | None = None,
    ) -> list[StepMetrics]:
        """Run `steps` steps (`batches` yields each step's micro-batches); every `eval_every` steps evaluate
        on `eval_batches()`."""
        self._call("on_train_begin", self)
        results, unsettled = [], 0
        try:
            for _ in range(steps):
                results.append(self.train_step(next(batches)))
                # the earlier steps' metrics whose values have reached the host are read (nothing waits):
                # a long run keeps numbers, not a pinned buffer per step
                while unsettled < len(results) - 1 and results[unsettled].settle_if_arrived():
                    unsettled += 1
                if eval_every and eval_batches is not None and self.step % eval_every == 0:
                    self.evaluate(eval_batches())
        finally:
            self._call("on_train_end", self)
        return results

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple]) -> float:
        """The mean loss over `batches` (no gradients)."""
        loss = self._eval_loss(batches)
        self._call("on_eval_end", self, {"loss": loss})
        return loss

    def _eval_loss(self, batches: Iterable[tuple]) -> float:
        return self.steps.eval_loss(self, [self._on_device(batch) for batch in batches])

    def _grad_views(self) -> list[GradView]:
        """The step's gradients as this rank holds them."""
        return self.steps.grad_views(self)

    def _call(self, hook: str, *args: object) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)


def _balances_by_bias(model: nn.Module) -> bool:
    """Whether a mixture of experts in `model` moves balancing biases after each step taken."""
    return any(moe.config.expert_bias for moe in moe_layers(model))


# The torch optimizers whose fused kernels read `found_inf` and skip the whole update where it is 1 (torch
# 2.13's torch/optim: adam.py, adamw.py, sgd.py, adagrad.py; `_adafactor.py` takes the argument but refuses
# it). Exact classes: a subclass may step otherwise.
FOUND_INF_READERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _skips_on_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips a step on the device: one of `FOUND_INF_READERS`, fused in every group."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return type(optimizer) in FOUND_INF_READERS and fused


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`values` copied to the host without waiting: on a GPU into pinned memory, with the event that
    marks the copy done (wait for it before reading); on a CPU they are there already (no event). The
    step's metrics then hold no device memory."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(values.device))
    return host, ready


def _step_unless(optimizer: torch.optim.Optimizer, inner: list, found_inf: torch.Tensor) -> None:
    """`optimizer.step()`, which the `inner` fused optimizers skip on the device where `found_inf` is 1."""
    for each in inner:
        each.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        for each in inner:
            del each.found_inf  # a later step of a non-fused path must not see it


class StepClock:
    """A step's duration without a host synchronisation: CUDA events on a GPU (read with the metrics), the
    host's clock on a CPU (whose work is done when the host moves on)."""

    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.events = None
        self.stream = None
        if device.type == "cuda":  # the events go on the stream the step's work is queued on
            self.stream = torch.cuda.current_stream(device)
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record(self.stream)

    def stop(self) -> Callable[[], float]:
        """The step ends now: a function giving its seconds (on a GPU it waits for the end event)."""
        if self.events is None:
            seconds = time.perf_counter() - self.start
            return lambda: seconds
        begin, end = self.events
        end.record(self.stream)
        return lambda: begin.elapsed_time(end) / 1000.0


def _mesh_of(model: nn.Module) -> Mesh | None:
    """The mesh `model` is laid out on, else the current one (None outside `loom.init`)."""
    state = getattr(model, "loom", None)
    return state.mesh if state is not None else current_mesh()
