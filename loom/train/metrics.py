"""What a training run reports: model FLOPs and MFU, per-step metrics, a logger, and callbacks.

`MetricsLogger` writes one JSON line per logged step (rank 0 only), TensorBoard scalars when TensorBoard is
installed and a directory is given, and a rich progress bar on a terminal (a plain line every `log_every`
steps otherwise). Callbacks see a duck-typed `trainer` and read only `trainer.step` and `trainer.is_main`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "Callback",
    "LossMonitor",
    "MetricsCallback",
    "MetricsLogger",
    "StepMetrics",
    "mfu",
    "model_flops_per_token",
    "peak_memory_bytes",
]


def model_flops_per_token(n_params_non_embedding: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: `6 N + 12 L d s` (forward and backward).

    `6 N`: each of the N non-embedding weights does one multiply-add (2 FLOPs) per token forward and two
    backward (input and weight gradients); N counts the output head also when it is tied to the token
    table (`loom.train.job.flop_parameters`), which a table lookup alone leaves out. `12 L d s`: attention scores and the weighted sum of values,
    `2 * 2 * d * s` FLOPs per token and layer forward (for a context of s tokens), times 3 with the backward
    (PaLM, Chowdhery et al. 2022, appendix B; no causal discount). Recomputation is not counted: MFU
    counts the model's FLOPs, not the hardware's.
    """
    return 6.0 * n_params_non_embedding + 12.0 * n_layers * d_model * seq_len


def mfu(
    tokens_per_s: float, flops_per_token: float, peak_flops: float | None, n_devices: int = 1
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of `n_devices` (None if no peak known)."""
    if not peak_flops or n_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * n_devices)


def peak_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Peak memory of this rank: CUDA `max_memory_allocated` on a GPU; on CPU the process's maximum resident
    set size (`getrusage`, which includes the Python interpreter and torch itself). None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type != "cpu":
        return None
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class _Deferred:
    """A `StepMetrics` field whose value the Trainer may leave on the device: the first read of any such
    field settles them all at once (one host synchronisation for the step's loss, norm, skip and time)."""

    REQUIRED = object()  # a field with no default: `StepMetrics(...)` must be given it

    def __init__(self, default: Any = REQUIRED) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:  # the dataclass asks the class for the field's default
            if self.default is _Deferred.REQUIRED:
                raise AttributeError(self.slot[1:])  # no default: the dataclass makes the field required
            return self.default
        if obj.__dict__.get("_pending") is not None:
            obj.settle()
        return obj.__dict__.get(self.slot, self.default)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = value


@dataclass(kw_only=True)
class StepMetrics:
    """One optimizer step, as every rank sees it (`tokens` counts the global batch).

    The Trainer builds it with `StepMetrics.deferred`: the loss, gradient norm, skip flag and timings stay
    on the device until something reads one of them (a logger at `log_every`, a callback), so that a step
    needs no host synchronisation of its own. Read, they are plain Python numbers. A pickled one is read
    first (`pickle` carries plain numbers)."""

    step: int
    loss: float = _Deferred()
    lr: float
    grad_norm: float | None = _Deferred(None)
    tokens: int = 0
    step_time_s: float = _Deferred(0.0)
    tokens_per_s: float = _Deferred(0.0)
    mfu: float | None = _Deferred(None)
    peak_memory_bytes: int | None = None
    loss_scale: float | None = None
    skipped: bool = _Deferred(False)  # the optimizer step was skipped (not finite; fp16 overflow)

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def deferred(
        cls,
        settle: Callable[[], dict[str, Any]],
        skipped_on_device: Any = None,
        arrived: Callable[[], bool] | None = None,
        **known: Any,
    ) -> StepMetrics:
        """Metrics whose deferred fields `settle()` computes (reading the device) when first read (the loss
        among them). `skipped_on_device`: the skip flag as a device tensor, for callbacks that count
        skipped steps without reading it (`skipped_flag`), until the metrics are read. `arrived`: whether
        the values have reached the host (asked without waiting, `settle_if_arrived`); None: never asked."""
        metrics = cls(loss=math.nan, **known)
        metrics.__dict__["_pending"] = settle
        metrics.__dict__["_skipped_on_device"] = skipped_on_device
        metrics.__dict__["_arrived"] = arrived
        return metrics

    def settle_if_arrived(self) -> bool:
        """Settle now if the deferred values have reached the host (a read that waits for nothing), so that
        metrics kept unread give back their host buffers; whether the metrics are settled."""
        arrived = self.__dict__.get("_arrived")
        if self.__dict__.get("_pending") is not None and arrived is not None and arrived():
            self.settle()
        return self.__dict__.get("_pending") is None

    def skipped_flag(self) -> torch.Tensor:
        """Whether the step was skipped, as a tensor: on the device, unread, while the metrics are deferred
        and the step's callbacks run; else a CPU tensor of `skipped` (read)."""
        flag = self.__dict__.get("_skipped_on_device")
        if self.__dict__.get("_pending") is not None and flag is not None:
            return flag
        return torch.tensor(self.skipped)

    def release_device_flag(self) -> None:
        """Let go of the device skip flag (the Trainer does, once the step's callbacks have seen it):
        metrics kept unread hold no device memory; `skipped_flag` then reads the flag."""
        self.__dict__.pop("_skipped_on_device", None)

    def __getstate__(self) -> dict[str, Any]:
        """Plain numbers for pickle: the deferred fields read first."""
        self.settle()
        return {k: v for k, v in self.__dict__.items() if k not in ("_skipped_on_device", "_arrived")}

    def settle(self) -> StepMetrics:
        """Read the deferred fields from the device now (a no-op once read); returns self."""
        pending = self.__dict__.pop("_pending", None)
        if pending is not None:
            self.__dict__.pop("_skipped_on_device", None)  # held only until read
            self.__dict__.pop("_arrived", None)
            for name, value in pending().items():
                setattr(self, name, value)
            self._check()
        return self

    def _check(self) -> None:
        if self.step < 0 or self.tokens < 0 or self.step_time_s < 0:
            raise ValueError(f"StepMetrics: step, tokens and step_time_s must be >= 0, got {self}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a JSON line."""
        return dataclasses.asdict(self)


def _format(m: StepMetrics) -> str:
    parts = [f"loss {m.loss:.4f}", f"lr {m.lr:.2e}"]
    if m.grad_norm is not None:
        parts.append(f"grad_norm {m.grad_norm:.3f}")
    parts.append(f"tok/s {m.tokens_per_s:,.0f}")
    if m.mfu is not None:
        parts.append(f"mfu {100 * m.mfu:.1f}%")
    if m.peak_memory_bytes is not None:
        parts.append(f"mem {m.peak_memory_bytes / 2**30:.2f}GiB")
    if m.skipped:
        parts.append("skipped")
    return " | ".join(parts)


class MetricsLogger:
    """Reports steps and evaluations of rank 0 (`is_main`); on other ranks every method does nothing.

    A step is logged when `step % log_every == 0` or it is the last (`total_steps`): one JSON line in
    `metrics_file` (appended, flushed), TensorBoard scalars under `tensorboard_dir` (when TensorBoard is
    installed; a warning otherwise). The progress bar advances every step; it is shown when `console` is
    true and `stream` is a terminal, and otherwise a plain line is printed at each logged step
    (`console=False` prints nothing). Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        metrics_file: str | Path | None = None,
        *,
        is_main: bool,
        total_steps: int | None = None,
        log_every: int = 1,
        tensorboard_dir: str | Path | None = None,
        console: bool = True,
        stream: IO[str] | None = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.is_main, self.total_steps, self.log_every, self.console = (
            is_main,
            total_steps,
            log_every,
            console,
        )
        self.stream = stream if stream is not None else sys.stdout
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._progress: Any = None
        self._task: Any = None
        if not is_main:
            return
        if metrics_file is not None:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(metrics_file, "a", encoding="utf-8")  # noqa: SIM115 -- closed in close()
        if tensorboard_dir is not None:
            self._writer = _summary_writer(tensorboard_dir)
        if console and self.stream.isatty():
            self._progress = _progress_bar(self.stream, total_steps)
            self._task = self._progress.add_task("train", total=total_steps, info="")

    def should_log(self, step: int) -> bool:
        """Whether `step` is reported (every `log_every` steps and the last)."""
        return step % self.log_every == 0 or step == self.total_steps

    def log(self, metrics: StepMetrics) -> None:
        """Record one step: advance the bar; at logged steps write the line, scalars and text."""
        if not self.is_main:
            return
        if not self.should_log(metrics.step):
            if (
                self._progress is not None
            ):  # the numbers wait for a logged step: reading them syncs the device
                self._progress.update(self._task, completed=metrics.step)
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=metrics.step, info=_format(metrics))
        self._write({"kind": "step", **metrics.to_dict()})
        if self._writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale"):
                value = getattr(metrics, key)
                if value is not None:
                    self._writer.add_scalar(f"train/{key}", value, metrics.step)
        if self._progress is None and self.console:
            total = f"/{self.total_steps}" if self.total_steps else ""
            print(f"step {metrics.step}{total} | {_format(metrics)}", file=self.stream, flush=True)

    def log_eval(self, step: int, results: dict[str, float]) -> None:
        """Record an evaluation (e.g. `{"loss": 1.2, "accuracy": 0.8}`) at `step`."""
        if not self.is_main:
            return
        self._write({"kind": "eval", "step": step, **results})
        if self._writer is not None:
            for key, value in results.items():
                self._writer.add_scalar(f"eval/{key}", value, step)
        if self.console:
            text = " | ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()
            )
            line = f"eval step {step} | {text}"
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.stream, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # readable while training runs (tail -f), and complete after a crash

    def close(self) -> None:
        """Stop the progress bar and close the file and the TensorBoard writer."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer(log_dir: str | Path) -> Any:
    """A TensorBoard SummaryWriter, or None (with a warning) when TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            f"tensorboard_dir={str(log_dir)!r} is set but TensorBoard is not installed; "
            "`pip install tensorboard` to get event files (the JSONL metrics file is still written)",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=str(log_dir))


def _progress_bar(stream: IO[str], total_steps: int | None) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(file=stream),
    )
    progress.start()
    return progress


class Callback:
    """Hooks the Trainer calls; all do nothing here, so a subclass overrides only what it needs.

    `trainer` is duck-typed: callbacks may read `trainer.step` (completed steps) and `trainer.is_main`.
    """

    def on_train_begin(self, trainer: Any) -> None:
        """Before the first step."""

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        """After each optimizer step (also a skipped one, with `metrics.skipped`)."""

    def on_eval_end(self, trainer: Any, results: dict[str, float]) -> None:
        """After each evaluation, with its results (e.g. `{"loss": ..., "accuracy": ...}`)."""

    def on_train_end(self, trainer: Any) -> None:
        """After the last step (also when training stops early)."""


class LossMonitor(Callback):
    """Prints the loss every `every` steps, and evaluation results, on rank 0."""

    def __init__(self, every: int = 10, stream: IO[str] | None = None) -> None:
        if every < 1:
            raise ValueError(f"LossMonitor(every={every}): every must be >= 1")
        self.every, self.stream = every, stream

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        if trainer.is_main and trainer.step % self.every == 0:
            print(f"step {trainer.step} loss {metrics.loss:.4f}", file=self.stream or sys.stdout, flush=True)

    def on_eval_end(self, trainer: Any, results: dict[str, float]) -> None:
        if trainer.is_main:
            text = " ".join(f"{k} {v:.4g}" for k, v in results.items())
            print(f"step {trainer.step} eval {text}", file=self.stream or sys.stdout, flush=True)


class MetricsCallback(Callback):
    """Sends steps and evaluations to a `MetricsLogger`, and closes it when training ends."""

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        self.logger.log(metrics)

    def on_eval_end(self, trainer: Any, results: dict[str, float]) -> None:
        self.logger.log_eval(trainer.step, results)

    def on_train_end(self, trainer: Any) -> None:
        self.logger.close()
