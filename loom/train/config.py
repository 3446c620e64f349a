"""Training configuration: a TOML file read into validated dataclasses, with command-line overrides.

A config has six sections, each a dataclass whose fields are the TOML keys (all have defaults):
`[model]` (`ModelConfig`), `[data]` (`DataConfig`), `[parallel]` (`ParallelConfig`), `[train]`
(`TrainingConfig`), `[checkpoint]` (`CheckpointConfig`) and `[fault]` (`FaultConfig`), gathered in
`TrainConfig`.

Types are enforced from the field annotations (an int where a float is expected is accepted; a bool is never
an int), ranges in each section's `__post_init__`, and rules that span sections in `TrainConfig.validate`.
Every error names `section.key`, the value, and what is allowed.

    cfg = load_config("configs/gpt.toml", ["--train.steps", "100", "--parallel.tp=2"])
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import tomllib
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FaultConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
    "load_config",
    "parse_overrides",
]

_TRUE, _FALSE, _NONE = ("true", "1", "yes", "on"), ("false", "0", "no", "off"), ("none", "null")


def _describe_type(hint: Any) -> str:
    """A type as a user reads it: "an integer", "one of ('gelu', 'swiglu')", "a float or none"."""
    if get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in get_args(hint) if a is not type(None)]
        return f"{_describe_type(inner[0])} or none"
    if get_origin(hint) is Literal:
        return f"one of {get_args(hint)}"
    if get_origin(hint) is tuple:
        plural = {int: "integers", float: "numbers", str: "strings"}[get_args(hint)[0]]
        return f"{len(get_args(hint))} comma-separated {plural}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def _coerce(where: str, value: Any, hint: Any) -> Any:
    """`value` (as TOML or Python gives it) checked against the annotation `hint`, ints widened to floats."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in get_args(hint) if a is not type(None)]
        return _coerce(where, value, inner[0])
    if origin is Literal:
        if value not in get_args(hint):
            raise ValueError(f"{where} = {value!r} is not allowed; use one of {get_args(hint)}")
        return value
    if origin is tuple:
        items = get_args(hint)
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise ValueError(f"{where} = {value!r}: expected {_describe_type(hint)}, e.g. [0.9, 0.95]")
        return tuple(_coerce(where, v, h) for v, h in zip(value, items, strict=True))
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ValueError(f"{where} = {value!r} is {type(value).__name__}; expected {_describe_type(hint)}")
    return value


def _parse_text(where: str, text: str, hint: Any) -> Any:
    """A command-line string converted to the type of `hint` (then checked by `_coerce`)."""
    origin, lowered = get_origin(hint), text.strip().lower()
    if origin in (Union, types.UnionType):
        if lowered in _NONE:
            return None
        return _parse_text(where, text, next(a for a in get_args(hint) if a is not type(None)))
    if origin is tuple:
        parts = [p for p in text.strip("()[] ").split(",") if p.strip()]
        if len(parts) != len(get_args(hint)):
            raise ValueError(f"{where} = {text!r}: expected {_describe_type(hint)}, e.g. 0.9,0.95")
        return tuple(_parse_text(where, p, h) for p, h in zip(parts, get_args(hint), strict=True))
    try:
        if hint is bool:
            if lowered not in _TRUE + _FALSE:
                raise ValueError
            return lowered in _TRUE
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise ValueError(f"{where} = {text!r} is not {_describe_type(hint)}") from None
    return text  # str and Literal (checked against the choices by `_coerce`)


@dataclass(kw_only=True)
class _Section:
    """Base of the sections: type checks from annotations, then the section's own range checks."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, hint in self.field_types().items():
            setattr(self, name, _coerce(f"{self.SECTION}.{name}", getattr(self, name), hint))
        self.check()

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Annotation of each TOML key of this section."""
        hints = get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    def check(self) -> None:
        """Range checks of this section's values (type checks have run)."""

    def _fail(self, key: str, allowed: str) -> None:
        raise ValueError(f"{self.SECTION}.{key} = {getattr(self, key)!r} is out of range: {allowed}")

    def _at_least(self, low: int | float, *keys: str) -> None:
        for key in keys:
            value = getattr(self, key)
            if value is not None and value < low:
                self._fail(key, f"use a value >= {low}")


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """`[model]`: a GPT-style decoder. `n_kv_heads=None` means n_heads (no grouped-query attention),
    `d_ff=None` means 4 * d_model."""

    SECTION: ClassVar[str] = "model"
    name: Literal["gpt"] = "gpt"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 64
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    positions: Literal["learned", "rotary"] = "learned"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    tie_embeddings: bool = True
    dropout: float = 0.0

    def check(self) -> None:
        self._at_least(1, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")
        if self.d_model % self.n_heads:
            self._fail("d_model", f"it must be divisible by model.n_heads = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            self._fail("n_kv_heads", f"it must divide model.n_heads = {self.n_heads}")
        if self.positions == "rotary" and self.head_dim % 2:
            self._fail(
                "d_model", f"rotary positions need an even head dim, d_model / n_heads = {self.head_dim}"
            )
        if not 0 <= self.dropout < 1:
            self._fail("dropout", "use a probability in [0, 1)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when unset)."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden size of the MLP (d_ff, or 4 * d_model when unset)."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        """d_model / n_heads."""
        return self.d_model // self.n_heads


@dataclass(kw_only=True)
class DataConfig(_Section):
    """`[data]`: `kind = "arithmetic"` (built-in synthetic corpus), `"tokens"` (a `.bin` file of token ids
    of `dtype`) or `"text"` (a UTF-8 file, byte tokens); `path` is the file for the last two."""

    SECTION: ClassVar[str] = "data"
    kind: Literal["arithmetic", "tokens", "text"] = "arithmetic"
    path: str | None = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int = 32
    seed: int = 0
    max_operand: int = 9  # single digits: learnable in a few hundred steps (see ArithmeticCorpus)

    def check(self) -> None:
        self._at_least(1, "seq_len", "max_operand")
        if self.kind != "arithmetic" and self.path is None:
            raise ValueError(f"data.kind = {self.kind!r} needs data.path: set it to the file to train on")


@dataclass(kw_only=True)
class ParallelConfig(_Section):
    """`[parallel]`: mesh sizes (`dp = -1` takes the devices left by tp and pp), the pipeline schedule and
    micro-batches, sequence parallelism, the optimizer level (ZeRO stage 0-3) and recomputation."""

    SECTION: ClassVar[str] = "parallel"
    dp: int = -1
    tp: int = 1
    pp: int = 1
    schedule: Literal["1f1b", "gpipe", "interleaved", "zero_bubble"] = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    optimizer_level: int = 0
    recompute: Literal["none", "full", "selective"] = "none"

    def check(self) -> None:
        if self.dp != -1 and self.dp < 1:
            self._fail("dp", "use a size >= 1, or -1 to fill the devices left by tp and pp")
        self._at_least(1, "tp", "pp", "microbatches")
        if not 0 <= self.optimizer_level <= 3:
            self._fail("optimizer_level", "use 0 (none), 1 (states), 2 (+ gradients) or 3 (+ parameters)")

    def dp_size(self, world_size: int) -> int:
        """The data-parallel size on `world_size` devices (`dp = -1` filled in), checked against tp * pp."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        dp = world_size // (self.tp * self.pp) if self.dp == -1 else self.dp
        if dp < 1 or dp * self.tp * self.pp != world_size:
            raise ValueError(
                f"parallel.dp * tp * pp = {self.dp} * {self.tp} * {self.pp} does not fill {world_size} devices; "
                f"make the product {world_size} (dp = -1 fills in)"
            )
        return dp

    def mesh_sizes(self, world_size: int) -> dict[str, int]:
        """Axis sizes for `loom.init`, outermost first: pp, dp, tp (tp innermost, on the fastest links).
        Axes of size 1 other than dp are left out."""
        sizes = {"pp": self.pp, "dp": self.dp_size(world_size), "tp": self.tp}
        return {axis: size for axis, size in sizes.items() if size > 1 or axis == "dp"}


@dataclass(kw_only=True)
class TrainingConfig(_Section):
    """`[train]`: the loop (steps, batch, accumulation), optimizer and schedule, precision and loss scaling,
    evaluation and logging. `global_batch` counts sequences per optimizer step over all data-parallel ranks;
    `workers` is the number of local processes `loom train` starts."""

    SECTION: ClassVar[str] = "train"
    steps: int = 300
    global_batch: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8  # AdamW's epsilon
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.9
    clip_grad_norm: float | None = 1.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    workers: int = 1
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    sample_every: int = 0

    def check(self) -> None:
        self._at_least(1, "steps", "global_batch", "grad_accum", "loss_scale_growth_interval")
        self._at_least(1, "eval_batches", "log_every", "workers")
        self._at_least(0, "warmup_steps", "weight_decay", "min_lr", "eval_every", "sample_every")
        for key in ("lr", "eps", "loss_scale_init", "clip_grad_norm"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                self._fail(
                    key, "use a value > 0" + (" (or none to disable)" if key == "clip_grad_norm" else "")
                )
        if self.min_lr > self.lr:
            self._fail("min_lr", f"it must not exceed train.lr = {self.lr}")
        if not all(0 < b < 1 for b in self.betas):
            self._fail("betas", "use two numbers in (0, 1), e.g. [0.9, 0.95]")
        if not 0 <= self.momentum < 1:
            self._fail("momentum", "use a value in [0, 1)")


@dataclass(kw_only=True)
class CheckpointConfig(_Section):
    """`[checkpoint]`: where and how often to save (0 = never by that criterion), how many to keep,
    whether saving overlaps training, and whether a failed save stops training or is reported and skipped."""

    SECTION: ClassVar[str] = "checkpoint"
    dir: str | None = None
    every_steps: int = 0
    every_minutes: float = 0.0
    keep_last: int = 3
    async_save: bool = False
    on_save_error: Literal["stop", "continue"] = "stop"

    def check(self) -> None:
        self._at_least(0, "every_steps", "every_minutes")
        self._at_least(1, "keep_last")
        if self.dir is None and (self.every_steps or self.every_minutes):
            raise ValueError(
                "checkpoint.every_steps / every_minutes are set but checkpoint.dir is not; set dir"
            )


@dataclass(kw_only=True)
class FaultConfig(_Section):
    """`[fault]`: how `loom train` survives failures. A worker that dies, raises during training or sends no
    heartbeat for `heartbeat_timeout_s` (0: no hang detection; one beat per step and per start-up phase, so
    a rank that hangs while building the model or loading a checkpoint is caught too) stops the job, which
    restarts from the last checkpoint up to `max_restarts` times; `collective_timeout_s` bounds one
    collective. A step whose loss
    or gradient norm is not finite is skipped (`skip_nonfinite`); after `rollback_after` such steps in a row
    (0: never) the job rolls back to the last checkpoint and skips the data that failed."""

    SECTION: ClassVar[str] = "fault"
    max_restarts: int = 3
    heartbeat_timeout_s: float = 300.0
    collective_timeout_s: float = 1800.0
    skip_nonfinite: bool = True
    rollback_after: int = 3

    def check(self) -> None:
        self._at_least(0, "max_restarts", "heartbeat_timeout_s", "rollback_after")
        if self.collective_timeout_s <= 0:
            self._fail("collective_timeout_s", "use a value > 0")
        if self.rollback_after and not self.skip_nonfinite:
            raise ValueError(
                "fault.rollback_after counts skipped steps: it needs fault.skip_nonfinite = true"
            )


_SECTIONS: dict[str, type[_Section]] = {
    cls.SECTION: cls
    for cls in (ModelConfig, DataConfig, ParallelConfig, TrainingConfig, CheckpointConfig, FaultConfig)
}


def _unknown(kind: str, name: str, valid: Sequence[str], where: str) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown {kind} {name!r} in {where}{hint}; valid {kind}s: {', '.join(valid)}")


def _section_class(section: str, where: str) -> type[_Section]:
    if section not in _SECTIONS:
        raise _unknown("section", section, list(_SECTIONS), where)
    return _SECTIONS[section]


def _field_type(section: str, key: str, where: str) -> Any:
    types_ = _section_class(section, where).field_types()
    if key not in types_:
        raise _unknown("key", f"{section}.{key}", [f"{section}.{k}" for k in types_], where)
    return types_[key]


@dataclass(kw_only=True)
class TrainConfig:
    """A whole training run: the six sections. Build one with `load_config` or `TrainConfig.from_dict`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"TrainConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}; "
                    "use TrainConfig.from_dict for plain data"
                )
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the config") -> TrainConfig:
        """A config from nested plain data (`{"train": {"steps": 100}}`), as TOML or `to_dict` gives it."""
        sections = {}
        for section, table in data.items():
            section_cls = _section_class(section, where)
            if not isinstance(table, dict):
                raise ValueError(f"[{section}] in {where} must be a table of keys, got {table!r}")
            for key in table:
                _field_type(section, key, where)
            sections[section] = section_cls(**table)
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested data (JSON-ready: tuples become lists), e.g. for the metrics log or a checkpoint."""
        return {name: _jsonable(dataclasses.asdict(getattr(self, name))) for name in _SECTIONS}

    def describe(self) -> str:
        """A compact, printable summary: one wrapped block of `key=value` per section."""
        lines = []
        for name, values in self.to_dict().items():
            body = " ".join(f"{k}={v}" for k, v in values.items())
            lines.append(textwrap.fill(body, 108, initial_indent=f"{name:<11}", subsequent_indent=" " * 11))
        return "\n".join(lines)

    def validate(self, world_size: int | None = None) -> TrainConfig:
        """Check the rules that span sections; with `world_size`, also the mesh and the batch split.

        Returns self, so that `cfg = load_config(...).validate(world_size)` reads naturally.
        """
        model, data, par = self.model, self.data, self.parallel
        if data.seq_len > model.max_seq_len:
            raise ValueError(
                f"data.seq_len = {data.seq_len} exceeds model.max_seq_len = {model.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        if data.kind != "tokens" and model.vocab_size < 256:
            raise ValueError(
                f"data.kind = {data.kind!r} uses byte tokens (0..255) but model.vocab_size = {model.vocab_size}; "
                "set model.vocab_size >= 256"
            )
        for what, size in (("n_heads", model.n_heads), ("kv heads", model.kv_heads), ("d_ff", model.ffn_dim)):
            if size % par.tp:
                raise ValueError(
                    f"parallel.tp = {par.tp} must divide model {what} = {size}; choose another tp"
                )
        if par.pp > model.n_layers:
            raise ValueError(f"parallel.pp = {par.pp} exceeds model.n_layers = {model.n_layers}; lower pp")
        dp = par.dp_size(world_size) if world_size is not None else (None if par.dp == -1 else par.dp)
        if dp is not None:
            self._check_batch_split(dp)
        return self

    def _check_batch_split(self, dp: int) -> None:
        train, par = self.train, self.parallel
        if train.global_batch % (dp * train.grad_accum):
            raise ValueError(
                f"train.global_batch = {train.global_batch} is not divisible by dp * grad_accum = "
                f"{dp} * {train.grad_accum}; use a multiple of {dp * train.grad_accum}"
            )
        rows = train.global_batch // (dp * train.grad_accum)
        if par.pp > 1 and rows % par.microbatches:
            raise ValueError(
                f"a micro-batch step of {rows} rows per data-parallel rank is not divisible by "
                f"parallel.microbatches = {par.microbatches}; change global_batch or microbatches"
            )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Command-line overrides (`--train.steps 100`, `--parallel.tp=2`) as nested, typed plain data."""
    result: dict[str, dict[str, Any]] = {}
    items = list(overrides)
    i = 0
    while i < len(items):
        arg = items[i]
        name = arg.removeprefix("--")
        if "=" in name:
            name, text = name.split("=", 1)
            i += 1
        elif i + 1 < len(items):
            text, i = items[i + 1], i + 2
        else:
            raise ValueError(
                f"override {arg!r} has no value; write --section.key VALUE or --section.key=VALUE"
            )
        if name.count(".") != 1:
            raise ValueError(f"override {arg!r} must name section.key, e.g. --train.steps 100")
        section, key = name.split(".")
        hint = _field_type(section, key, "the command-line overrides")
        result.setdefault(section, {})[key] = _parse_text(f"{section}.{key}", text, hint)
    return result


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a TOML config (None: all defaults), apply command-line `overrides`, and validate the result."""
    data: dict[str, Any] = {}
    where = "the config"
    if path is not None:
        where = str(path)
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except FileNotFoundError:
            raise ValueError(f"config file {where!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {where!r} is not valid TOML: {exc}") from None
    for section, values in parse_overrides(overrides).items():
        table = data.setdefault(section, {})
        if isinstance(table, dict):
            table.update(values)
    return TrainConfig.from_dict(data, where)
