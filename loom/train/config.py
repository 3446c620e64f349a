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
import os
import re
import textwrap
import tomllib
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig, transformer_config
from loom.models.config import ATTENTION_KERNELS, MLPS, NORMS, POSITIONS, GPTConfig
from loom.plan import ATTENTIONS, PRECISIONS, RECOMPUTE, SCHEDULE_VIRTUAL, SCHEDULES, FieldError, Plan

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "FaultConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "TrainingConfig",
    "config_help",
    "load_config",
    "parse_overrides",
]

_TRUE, _FALSE, _NONE = ("true", "1", "yes", "on"), ("false", "0", "no", "off"), ("none", "null")

# `loom train` runs every pipeline schedule but zbv (its V placement is offered in Python only)
CONFIG_SCHEDULES = tuple(name for name in SCHEDULES if name != "zbv")
# how data-parallel replicas meet: gradients every step, or weights every `sync_every` steps
SYNCS = ("every_step", "local_sgd", "diloco")
# the keys of `[parallel]` that only DiLoCo reads
_DILOCO_KEYS = ("outer_lr", "outer_momentum", "fragments", "fragment_delay", "mix", "outer_dtype")
# the simulator also prices fp8; training computes in the others
TRAIN_PRECISIONS = tuple(name for name in PRECISIONS if name != "fp8")


def _describe_type(hint: Any) -> str:
    """A type as a user reads it: "an integer", "one of ('gelu', 'swiglu')", "a float or none"."""
    if get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in get_args(hint) if a is not type(None)]
        return f"{_describe_type(inner[0])} or none"
    if get_origin(hint) is Literal:
        return f"one of {get_args(hint)}"
    if get_origin(hint) is tuple:
        plural = {int: "integers", float: "numbers", str: "strings"}[get_args(hint)[0]]
        if get_args(hint)[-1] is Ellipsis:
            return f"comma-separated {plural}"
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
        if items[-1] is Ellipsis and isinstance(value, list | tuple):
            items = (items[0],) * len(value)
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
        items = get_args(hint)
        if items[-1] is Ellipsis:
            items = (items[0],) * len(parts)
        if len(parts) != len(items):
            raise ValueError(f"{where} = {text!r}: expected {_describe_type(hint)}, e.g. 0.9,0.95")
        return tuple(_parse_text(where, p, h) for p, h in zip(parts, items, strict=True))
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


def _key(default: Any, help: str) -> Any:
    """A TOML key: its default and the one line `loom train --help` prints for it (see `config_help`)."""
    return field(default=default, metadata={"help": help})


@dataclass(kw_only=True)
class _Section:
    """Base of the sections: type checks from annotations, then the section's own range checks."""

    SECTION: ClassVar[str] = ""
    # keys whose mere presence means something (a clash, a key the mode or sync does not read): `to_dict`
    # writes them only when given, so that reading its output back counts as given what was
    WRITTEN_WHEN_GIVEN: ClassVar[frozenset[str]] = frozenset()

    def __new__(cls, *args: Any, **kwargs: Any) -> _Section:
        # the keys the table, dict, override or caller held (`given`), whatever their values
        section = super().__new__(cls)
        object.__setattr__(section, "_keys_given", set(kwargs))
        object.__setattr__(section, "_built", False)
        return section

    def __post_init__(self) -> None:
        for name, hint in self.field_types().items():
            setattr(self, name, _coerce(f"{self.SECTION}.{name}", getattr(self, name), hint))
        self.check()
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if self._built and name in self.__dataclass_fields__:  # set by hand after construction: given
            self._keys_given.add(name)

    def given(self, key: str) -> bool:
        """True when `key` was given (by the TOML table, the dict, an override, or set by hand), whatever
        its value, even the default's; a key filled by a plan (`ParallelConfig.adopt`) is not given."""
        return key in self._keys_given

    def _fill(self, key: str, value: Any) -> None:
        """Set `key` from another source than the user (a plan's value): it stays not given."""
        object.__setattr__(self, key, value)

    def to_dict(self) -> dict[str, Any]:
        """The keys as plain data: every key, except those of `WRITTEN_WHEN_GIVEN` that were not given."""
        values = dataclasses.asdict(self)
        return {
            key: _jsonable(value)
            for key, value in values.items()
            if key not in self.WRITTEN_WHEN_GIVEN or self.given(key)
        }

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
    """`[model]`: a GPT-style decoder, the TOML surface of `loom.models.config.GPTConfig`, which holds the
    rules (checked when the config is read). `n_kv_heads=None` means n_heads (no grouped-query attention),
    `d_ff=None` means 4 * d_model.

    Or a Hugging Face causal LM: `hf_config` (a config.json, the model built with random weights) or
    `hf_pretrained` (a directory of config.json + safetensors weights). Its config is then the model's
    description: the other keys are filled in from it (`loom.models.hf.model_shape`; one given with another
    value is an error), but `dropout`, which belongs to loom's GPT alone."""

    SECTION: ClassVar[str] = "model"
    name: Literal["gpt"] = _key("gpt", "loom's reference GPT, unless hf_config or hf_pretrained is set")
    hf_config: str | None = _key(None, "a Hugging Face config.json: that causal LM, random weights")
    hf_pretrained: str | None = _key(
        None, "a directory with a Hugging Face config.json and safetensors weights: that model, trained"
    )
    vocab_size: int = _key(
        256, "token ids 0..vocab_size-1 (>= 256 for byte tokens: arithmetic and text data)"
    )
    d_model: int = _key(128, "hidden size; n_heads must divide it")
    n_layers: int = _key(2, "transformer blocks (at least pp stages' worth with pipelines)")
    n_heads: int = _key(4, "attention heads; parallel.tp must divide it")
    n_kv_heads: int | None = _key(None, "key/value heads for grouped-query attention (none: n_heads)")
    d_ff: int | None = _key(None, "MLP hidden size (none: 4 * d_model); parallel.tp must divide it")
    max_seq_len: int = _key(64, "longest sequence the model takes (>= data.seq_len)")
    norm: Literal[NORMS] = _key("layernorm", "normalisation layer")
    positions: Literal[POSITIONS] = _key("learned", "learned position embeddings or rotary (RoPE)")
    mlp: Literal[MLPS] = _key("gelu", "MLP kind: GELU or gated SwiGLU")
    attention_kernel: Literal[ATTENTION_KERNELS] = _key(
        "matmul",
        "attention as loom's operators (matmul) or F.scaled_dot_product_attention (sdpa: flash on GPU)",
    )
    tie_embeddings: bool = _key(True, "share the input embedding with the output head")
    dropout: float = _key(0.0, "dropout probability in [0, 1)")
    experts: int = _key(1, "experts per block: > 1 makes every MLP a mixture of experts of d_ff each")
    top_k: int = _key(2, "experts each token is routed to (<= experts)")
    capacity_factor: float | None = _key(
        None, "cap each expert at capacity_factor * tokens * top_k / experts pairs (none: dropless)"
    )
    aux_loss_coef: float = _key(0.01, "weight of the experts' load-balancing loss")
    z_loss_coef: float = _key(0.0, "weight of the router z-loss")
    expert_bias_rate: float = _key(0.0, "> 0: balance experts by a routing bias moved this much per step")

    def check(self) -> None:
        if self.is_hf:
            self._take_hf_shape()
        self.gpt_config()

    @property
    def is_hf(self) -> bool:
        """True when the model is a Hugging Face causal LM (`hf_config` or `hf_pretrained`)."""
        return self.hf_config is not None or self.hf_pretrained is not None

    def hf_model_config(self) -> Any:
        """The Hugging Face config of the model (read offline from `hf_config`, or `hf_pretrained`'s
        config.json); a ValueError naming the key when it is missing or not a causal LM."""
        from loom.models import hf  # transformers: only for Hugging Face models

        if self.hf_pretrained is not None:
            return hf.read_config(Path(self.hf_pretrained) / "config.json", "model.hf_pretrained")
        return hf.read_config(self.hf_config, "model.hf_config")

    def _take_hf_shape(self) -> None:
        """Fill the shape keys from the Hugging Face config; refuse keys it makes meaningless."""
        if self.hf_config is not None and self.hf_pretrained is not None:
            raise ValueError(
                "model.hf_config and model.hf_pretrained are both set; keep one (hf_pretrained's directory "
                "holds its own config.json)"
            )
        defaults = ModelConfig.__dataclass_fields__
        if self.dropout != defaults["dropout"].default:
            raise ValueError(
                f"model.dropout = {self.dropout!r} is loom's GPT's; a Hugging Face model's dropout is in its "
                "config.json: remove model.dropout"
            )
        from loom.models.hf import model_shape

        source = "hf_pretrained" if self.hf_pretrained is not None else "hf_config"
        for key, value in model_shape(self.hf_model_config()).items():
            given = getattr(self, key)
            if given not in (value, defaults[key].default):
                raise ValueError(
                    f"model.{key} = {given!r}, but model.{source}'s config says {value!r}; remove model.{key} "
                    "(the Hugging Face config describes the model)"
                )
            setattr(self, key, value)

    def gpt_config(self) -> GPTConfig:
        """The model's `GPTConfig` (what the workers build): the one place `[model]` becomes a model."""
        return GPTConfig.from_dict(vars(self))

    def transformer_config(self) -> TransformerConfig:
        """The model as the cost model and simulator see it."""
        return transformer_config(self.gpt_config(), name=self.name)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when unset)."""
        return self.gpt_config().kv_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden size of the MLP (d_ff, or 4 * d_model when unset)."""
        return self.gpt_config().ff_dim

    @property
    def head_dim(self) -> int:
        """d_model / n_heads."""
        return self.gpt_config().head_dim


@dataclass(kw_only=True)
class DataConfig(_Section):
    """`[data]`: `kind = "arithmetic"` (built-in synthetic corpus), `"tokens"` (`.bin` files of token ids of
    `dtype`), or documents to tokenise: `"text"` (UTF-8 files, one document each), `"jsonl"` or `"parquet"`
    (the `text_field` of each record or row). `path` is a file, a directory or a glob. Documents are
    tokenised by `tokenizer` (a local Hugging Face tokenizer; none: UTF-8 bytes), an end-of-sequence id
    follows each one, and they are packed into windows of `seq_len + 1` tokens (see `loom.train.data`)."""

    SECTION: ClassVar[str] = "data"
    kind: Literal["arithmetic", "tokens", "text", "jsonl", "parquet"] = _key(
        "arithmetic",
        "built-in sums, .bin files of token ids, or UTF-8 text, JSONL or Parquet files to tokenise",
    )
    path: str | None = _key(None, "the data for every kind but arithmetic: a file, a directory or a glob")
    dtype: Literal["uint16", "uint32"] = _key("uint16", "the id type of a tokens file")
    tokenizer: str | None = _key(None, "a tokenizer.json or a directory holding one (none: byte tokens)")
    text_field: str = _key("text", "the JSONL key or Parquet column that holds each document's text")
    eos_id: int | None = _key(
        None, "id after each document (none: the tokenizer's eos_token; byte tokens: no separator)"
    )
    cache_dir: str | None = _key(
        None, "where the tokenised corpus is kept for later starts (none: tokenise at every start)"
    )
    seq_len: int = _key(32, "tokens per training sequence (<= model.max_seq_len)")
    seed: int = _key(0, "seed of the arithmetic corpus (the order of the windows follows train.seed)")
    # single digits by default: learnable in a few hundred steps (see ArithmeticCorpus)
    max_operand: int = _key(9, "largest operand of the arithmetic task")

    def check(self) -> None:
        self._at_least(1, "seq_len", "max_operand")
        self._at_least(0, "eos_id")
        if self.kind != "arithmetic" and self.path is None:
            raise ValueError(f"data.kind = {self.kind!r} needs data.path: set it to the files to train on")
        if self.kind == "arithmetic" and self.tokenizer is not None:
            self._fail("tokenizer", "the arithmetic corpus is byte tokens; remove data.tokenizer")
        if not self.text_field:
            self._fail("text_field", "name the JSONL key or Parquet column that holds the text")

    def check_vocab(self, vocab_size: int) -> None:
        """A ValueError when the data's token ids (the tokenizer's vocabulary, byte tokens, `eos_id`) do not
        fit in `model.vocab_size`; reads the tokenizer file when one is set."""
        from loom.train.data import check_vocab_size  # torch and tokenizers: only when checked

        check_vocab_size(self, vocab_size)


AUTO_HARDWARE = "a100-80gb"
"""The profile `mode = "auto"` prices plans on when `parallel.hardware` is unset (`loom plan`'s default)."""


@dataclass(kw_only=True)
class ParallelConfig(_Section):
    """`[parallel]`: mesh sizes (`dp = -1` takes the devices left by tp and pp; `ep` carves expert
    parallelism out of dp), the pipeline schedule and micro-batches, sequence parallelism, the optimizer
    level (ZeRO stage 0-3) and recomputation.

    The TOML surface of a `loom.plan.Plan`: its rules are the Plan's, reported under `parallel.<key>`.
    Two other sources fill the same keys (`adopt`), so that everything downstream reads one description:
    `plan = "plan.json"`, a saved Plan (`loom plan --out`, `Plan.save`, a checkpoint's plan.json), run as it
    is; and `mode = "auto"`, the planner's choice on the run's world size (`loom.train.autoplan`, made by
    `TrainConfig.plan` / `validate` once the world size is known), priced on `hardware` under
    `memory_limit`."""

    SECTION: ClassVar[str] = "parallel"
    mode: Literal["manual", "auto"] = _key(
        "manual", "manual: the sizes below (or parallel.plan); auto: the planner chooses them"
    )
    plan: str | None = _key(
        None, "a plan.json (loom plan --out, Plan.save, a checkpoint's) run as is, instead of the sizes below"
    )
    memory_limit: str | None = _key(
        None, "mode = auto: bytes per device, or a size like '2GiB' (none: the hardware's memory)"
    )
    hardware: str | None = _key(
        None,
        f"mode = auto: the profile plans are priced on, a name or a loom bench file (none: {AUTO_HARDWARE})",
    )
    dp: int = _key(-1, "data-parallel size (-1: the devices left by tp and pp)")
    tp: int = _key(1, "tensor-parallel size (divides heads, kv heads, d_ff and vocab_size)")
    pp: int = _key(1, "pipeline-parallel size (stages over ranks)")
    ep: int = _key(1, "expert-parallel size: data-parallel ranks sharing a model's experts (divides dp)")
    schedule: Literal[CONFIG_SCHEDULES] = _key("1f1b", "pipeline schedule when pp > 1")
    microbatches: int = _key(1, "micro-batches per pipeline step (>= pp when pp > 1)")
    sequence_parallel: bool = _key(False, "cut the sequence over tp outside attention and MLP")
    cp: int = _key(1, "context-parallel size: each sequence cut over cp ranks (loom's GPT)")
    attention: Literal[ATTENTIONS] = _key("ulysses", "attention over the cp ranks: ulysses or ring")
    optimizer_level: int = _key(0, "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters")
    recompute: Literal[RECOMPUTE] = _key("none", "activation recomputation per block")
    stages: tuple[int, ...] | None = _key(
        None, "blocks per pipeline stage, in model order, one count per stage (uneven allowed); none: even"
    )
    # replicas over slow links (loom.parallel.local_sgd): the dp replicas step alone and meet every few steps
    sync: Literal[SYNCS] = _key(
        "every_step", "how dp replicas meet: gradients every step, or weights every sync_every steps"
    )
    sync_every: int = _key(50, "local_sgd, diloco: inner steps between two syncs of the replicas")
    replicas: int = _key(
        -1, "local_sgd, diloco: replicas stepping alone (divides dp; -1: dp, one per data-parallel index)"
    )
    outer_lr: float = _key(0.7, "diloco: learning rate of the outer SGD on the averaged pseudo-gradient")
    outer_momentum: float = _key(0.9, "diloco: the outer SGD's Nesterov momentum (0: plain SGD)")
    fragments: int = _key(1, "diloco: parameters cut into F fragments, each synced at its own step")
    fragment_delay: int = _key(
        0, "diloco: inner steps a fragment's average is overlapped with (< sync_every)"
    )
    mix: float = _key(0.5, "diloco with fragment_delay > 0: share of the local weights kept when it lands")
    outer_dtype: Literal["fp32", "bf16"] = _key("fp32", "diloco: dtype the pseudo-gradients travel in")

    def __post_init__(self) -> None:
        # TOML writes a byte count as a number: the key holds the text of either form
        if isinstance(self.memory_limit, int | float) and not isinstance(self.memory_limit, bool):
            self.memory_limit = str(self.memory_limit)
        self._source: Plan | None = None  # the Plan that filled the keys (`adopt`), if any
        self._origin = ""  # where it came from, for error messages
        super().__post_init__()

    def _check_sync(self) -> None:
        """The keys of `sync`: in range, and each set only for the syncs that read it."""
        self._at_least(1, "sync_every", "fragments")
        self._at_least(0, "fragment_delay")
        if self.outer_lr <= 0:
            self._fail("outer_lr", "use a value > 0 (1 with outer_momentum = 0 takes the average as it is)")
        if not 0 <= self.outer_momentum < 1:
            self._fail("outer_momentum", "use a value in [0, 1)")
        if not 0 <= self.mix <= 1:
            self._fail("mix", "use a value in [0, 1]")
        readers = {key: ("local_sgd", "diloco") for key in ("sync_every", "replicas")}
        readers.update((key, ("diloco",)) for key in _DILOCO_KEYS)
        for key, syncs in readers.items():
            if self.sync not in syncs and self.given(key):
                use = " or ".join(repr(sync) for sync in syncs)
                raise ValueError(
                    f"parallel.{key} = {getattr(self, key)!r} is read only with parallel.sync = {use}, not "
                    f"{self.sync!r}; remove parallel.{key} or set parallel.sync"
                )
        if self.sync != "diloco":
            return
        if self.fragments > self.sync_every:
            self._fail(
                "fragments",
                f"each fragment syncs once per sync_every = {self.sync_every} steps: use at most that",
            )
        if self.fragment_delay >= self.sync_every:
            self._fail(
                "fragment_delay",
                f"an average must land before its fragment's next sync: use less than sync_every = {self.sync_every}",
            )

    @property
    def replicas_step_alone(self) -> bool:
        """True when the data-parallel replicas step alone and meet every `sync_every` steps."""
        return self.sync != "every_step"

    def replica_count(self, dp: int) -> int:
        """How many replicas step alone among `dp` data-parallel ranks (`replicas`, or dp for -1): each has
        dp / replicas data-parallel ranks inside, which reduce their gradients every step."""
        return dp if self.replicas == -1 else self.replicas

    def check(self) -> None:
        if self.mode == "auto":
            self._check_auto()
        elif self.memory_limit is not None or self.hardware is not None:
            key = "memory_limit" if self.memory_limit is not None else "hardware"
            raise ValueError(
                f"parallel.{key} is the planner's: it needs parallel.mode = 'auto'; remove parallel.{key}"
            )
        if self.plan is not None:
            self.adopt(Plan.read(self.plan), f"parallel.plan = {self.plan!r}")
        self.to_plan()
        self._check_sync()

    def _check_auto(self) -> None:
        """`mode = "auto"`: the planner decides the sizes, so none is given; the memory limit parses."""
        if self.plan is not None:
            raise ValueError(
                f"parallel.mode = 'auto' and parallel.plan = {self.plan!r}: the planner would choose the plan "
                "the file gives; keep one (remove parallel.plan, or set parallel.mode = 'manual')"
            )
        given = [f"parallel.{key}" for key in _PLAN_KEYS.values() if self.given(key)]
        if given:
            raise ValueError(
                f"parallel.mode = 'auto' chooses {', '.join(given)} itself; remove {'it' if len(given) == 1 else 'them'}"
                " (or set parallel.mode = 'manual' to give the sizes)"
            )
        self.memory_limit_bytes()

    def memory_limit_bytes(self) -> int | None:
        """`memory_limit` in bytes (None when unset); a ValueError naming the key for an unreadable size."""
        if self.memory_limit is None:
            return None
        size = _size_in_bytes(self.memory_limit)
        if size is None or size <= 0:
            raise ValueError(
                f"parallel.memory_limit = {self.memory_limit!r} is not a size; give bytes per device (a number "
                "> 0) or a size with a unit, e.g. '2GiB', '512MiB', '8GB'"
            )
        return size

    def adopt(self, plan: Plan, origin: str, *, replace: bool = False) -> None:
        """Fill the keys from `plan`, which the run then uses as it is (`to_plan` returns it). `origin` names
        where it came from in errors. A key already given another value than the plan's is an error naming
        both, unless `replace` (the planner's choice replaces its previous one)."""
        operator_keys = (
            "strategies",
            "parameter_layouts",
            "recompute_modules",
            "primitives_follow_inputs",
            "compute_layouts",
            "input_layouts",
        )
        if any(getattr(plan, k) for k in operator_keys):
            given = [k for k in operator_keys if getattr(plan, k)]
            raise ValueError(
                f"{origin} has {', '.join(given)}: loom train lays out its models with their own tensor-parallel "
                "plans and one recompute policy; apply such a plan in Python with loom.parallelize(model, "
                "plan=...), or remove those entries"
            )
        if plan.stages is not None and not all(isinstance(n, int) for n in plan.stages):
            raise ValueError(
                f"{origin} gives stages as module paths; loom train cuts its blocks by counts: give blocks per "
                "stage, e.g. [2, 2]"
            )
        values = {key: getattr(plan, field) for field, key in _PLAN_KEYS.items()}
        values["stages"] = tuple(plan.stages) if plan.stages is not None else None
        if not replace:
            clashes = [
                f"parallel.{key} = {_shown(getattr(self, key))} (the plan: {_shown(value)})"
                for key, value in values.items()
                if self.given(key) and getattr(self, key) != value
            ]
            if clashes:
                raise ValueError(
                    f"{origin} and {'; '.join(clashes)} disagree: the plan file decides the parallel sizes; "
                    "remove those keys, or parallel.plan"
                )
        for key, value in values.items():
            if key == "schedule" and value not in CONFIG_SCHEDULES:
                raise ValueError(
                    f"{origin} runs schedule {value!r}, which loom train does not (use one of "
                    f"{CONFIG_SCHEDULES}; zbv is offered in Python only)"
                )
            self._fill(key, value)
        self._source, self._origin = plan, origin

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank: the adopted plan's, else the fewest the schedule runs."""
        if self._source is not None:
            return self._source.virtual_stages
        return SCHEDULE_VIRTUAL[self.schedule][0]

    @property
    def source(self) -> Plan | None:
        """The plan that filled the keys (`adopt`), as it was given, or None."""
        return self._source

    @property
    def origin(self) -> str | None:
        """Where the keys came from when a plan filled them (`parallel.plan = '...'`, the planner), else None."""
        return self._origin or None

    def to_plan(self, world_size: int | None = None, precision: str = "fp32") -> Plan:
        """This section as a Plan (`dp = -1` resolved when `world_size` is given). Each schedule runs its
        fewest virtual stages; without pipelines one micro-batch per step (`microbatches` is unused). An
        adopted plan (`adopt`) is returned as it is, with `precision`."""
        try:
            if self._source is not None:
                plan = self._source.replace(precision=precision)
            else:
                plan = Plan(
                    dp=self.dp,
                    tp=self.tp,
                    pp=self.pp,
                    ep=self.ep,
                    schedule=self.schedule,
                    virtual_stages=SCHEDULE_VIRTUAL[self.schedule][0],
                    micro_batches=self.microbatches if self.pp > 1 else 1,
                    sequence_parallel=self.sequence_parallel,
                    cp=self.cp,
                    attention=self.attention,
                    optimizer_level=self.optimizer_level,
                    recompute=self.recompute,
                    precision=precision,
                    stages=list(self.stages) if self.stages is not None else None,
                )
            return plan if world_size is None else plan.resolve(world_size)
        except FieldError as error:
            section, key = _CONFIG_KEYS.get(error.key, f"parallel.{error.key}").split(".")
            raise self.from_origin(error.renamed(section, key)) from None

    def from_origin(self, error: ValueError) -> ValueError:
        """`error` (about a [parallel] key) saying where the key's value came from, when a plan filled it."""
        note = f" (the [parallel] values come from {self._origin})"
        if self._source is None or note in str(error):
            return error
        if isinstance(error, FieldError):
            return FieldError(error.owner, error.key, error.value, error.fix + note)
        return ValueError(f"{error}{note}")

    def dp_size(self, world_size: int) -> int:
        """The data-parallel size on `world_size` devices (`dp = -1` filled in), checked against tp * pp."""
        return self.to_plan(world_size).dp

    def mesh_sizes(self, world_size: int) -> dict[str, int]:
        """Axis sizes for `loom.init`, outermost first: pp, dp, tp (tp innermost, on the fastest links).
        Axes of size 1 other than dp are left out."""
        return self.to_plan(world_size).mesh_sizes()


# the config key of each Plan field that `[parallel]` does not spell alike
_CONFIG_KEYS = {
    "micro_batches": "parallel.microbatches",
    "virtual_stages": "parallel.schedule",
    "precision": "train.precision",
    "world_size": "train.workers",
}

# the [parallel] key of each Plan field it has (precision is train.precision; virtual stages follow the
# schedule, or an adopted plan)
_PLAN_KEYS = {
    "dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp", "attention": "attention",
    "schedule": "schedule", "micro_batches": "microbatches", "sequence_parallel": "sequence_parallel",
    "optimizer_level": "optimizer_level", "recompute": "recompute", "stages": "stages",
}  # fmt: skip

# written by `to_dict` only when given: a plan file or the planner fills the sizes, and a sync refuses the keys
# it does not read
ParallelConfig.WRITTEN_WHEN_GIVEN = frozenset(_PLAN_KEYS.values()) | {"sync_every", "replicas", *_DILOCO_KEYS}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size_in_bytes(text: str) -> int | None:
    """'2GiB', '512 MiB', '8GB', '2e9' or '1073741824' in bytes; None when it is not a size."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _shown(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


@dataclass(kw_only=True)
class TrainingConfig(_Section):
    """`[train]`: the loop (steps, batch, accumulation), optimizer and schedule, precision and loss scaling,
    evaluation and logging. `global_batch` counts sequences per optimizer step over all data-parallel ranks;
    `workers` is the number of local processes `loom train` starts."""

    SECTION: ClassVar[str] = "train"
    steps: int = _key(300, "optimizer steps in the whole run")
    global_batch: int = _key(32, "sequences per optimizer step over all data-parallel ranks")
    grad_accum: int = _key(1, "gradient-accumulation micro-steps per optimizer step")
    lr: float = _key(3e-3, "peak learning rate")
    min_lr: float = _key(3e-4, "learning rate at the end of the schedule (<= lr)")
    warmup_steps: int = _key(20, "linear warm-up steps")
    schedule: Literal["cosine", "constant", "linear"] = _key("cosine", "learning-rate schedule after warm-up")
    weight_decay: float = _key(0.1, "decoupled weight decay")
    betas: tuple[float, float] = _key((0.9, 0.95), "AdamW's betas, two numbers in (0, 1)")
    eps: float = _key(1e-8, "AdamW's epsilon")  # AdamW's epsilon
    optimizer: Literal["adamw", "sgd"] = _key("adamw", "the optimizer")
    momentum: float = _key(0.9, "SGD's momentum")
    clip_grad_norm: float | None = _key(1.0, "global gradient-norm clip (none: no clipping)")
    precision: Literal[TRAIN_PRECISIONS] = _key("fp32", "compute precision (fp16 uses dynamic loss scaling)")
    device: Literal["auto", "cpu", "cuda"] = _key(
        "auto", "where each rank computes: cuda when every local rank has a GPU (auto), cpu, or cuda"
    )
    compile: bool = _key(False, "compile each transformer block with torch.compile")
    loss_scale_init: float = _key(2.0**16, "fp16's initial loss scale")
    loss_scale_growth_interval: int = _key(2000, "fp16: steps without overflow before the scale doubles")
    seed: int = _key(0, "seed of the model initialisation and of each step's random numbers")
    eval_every: int = _key(100, "evaluate every N steps (0: never)")
    eval_batches: int = _key(4, "held-out batches per evaluation")
    log_every: int = _key(10, "print and log metrics every N steps")
    workers: int = _key(1, "local worker processes loom train starts")
    metrics_file: str | None = _key(None, "append one JSON line per logged step here")
    tensorboard_dir: str | None = _key(None, "write TensorBoard scalars here (needs tensorboard)")
    sample_every: int = _key(0, "not used yet (the arithmetic task samples once, after training)")

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
    dir: str | None = _key(None, "directory of the checkpoints (created if missing; none: no checkpoints)")
    every_steps: int = _key(0, "save every N steps (0: not by steps)")
    every_minutes: float = _key(0.0, "save every M minutes (0: not by time)")
    keep_last: int = _key(3, "checkpoints kept; older ones are deleted")
    async_save: bool = _key(False, "write checkpoints in the background while training goes on")
    on_save_error: Literal["stop", "continue"] = _key(
        "stop", "a failed save stops training, or is reported and skipped"
    )

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
    max_restarts: int = _key(3, "restarts after a failure, from the last checkpoint")
    heartbeat_timeout_s: float = _key(
        300.0, "seconds a rank may stay silent before it counts as hung (0: never)"
    )
    collective_timeout_s: float = _key(1800.0, "seconds one collective may take")
    skip_nonfinite: bool = _key(True, "skip a step whose loss or gradient norm is not finite")
    rollback_after: int = _key(
        3, "roll back to the last checkpoint after N skipped steps in a row (0: never)"
    )
    elastic_replicas: bool = _key(
        False,
        "local_sgd, diloco with replicas of one process: a replica that dies or hangs is dropped from the "
        "next sync and a replacement joins there (no restart; max_restarts bounds the replacements)",
    )

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


def _refuse(refused: Iterable[tuple[str, Any, Any, str]], setting: str, otherwise: str) -> None:
    """A ValueError for the first `(key, value, allowed, why)` whose value is not the one `setting` allows,
    naming both and the two fixes: the allowed value, or `otherwise`."""
    for key, value, allowed, why in refused:
        if value != allowed:
            raise ValueError(f"{key} = {value} with {setting}: {why}; set {key} = {allowed} or {otherwise}")


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
        self._planned: dict[int, Any] = {}  # mode = "auto": the planner's choice per world size
        if self.parallel.source is not None:
            self._take_plan_precision()
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
        """Plain nested data (JSON-ready: tuples become lists), e.g. for a checkpoint: `from_dict` reads it
        back to this config. [parallel] keys a plan filled (`parallel.plan`, `mode = "auto"`) or a sync does
        not read are written only when given (`_Section.to_dict`)."""
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

    def describe(self) -> str:
        """A compact, printable summary: one wrapped block of `key=value` per section."""
        lines = []
        for name in _SECTIONS:
            values = _jsonable(dataclasses.asdict(getattr(self, name)))
            body = " ".join(f"{k}={v}" for k, v in values.items())
            lines.append(textwrap.fill(body, 108, initial_indent=f"{name:<11}", subsequent_indent=" " * 11))
        return "\n".join(lines)

    def _take_plan_precision(self) -> None:
        """A plan file's precision is the run's: `train.precision` left at its default takes it, another
        value is an error (the simulator's fp8 is not one loom train computes in)."""
        par, train = self.parallel, self.train
        precision = par.source.precision
        if precision not in TRAIN_PRECISIONS:
            raise ValueError(
                f"{par.origin} has precision = {precision!r}, which the simulator prices but loom train does not "
                f"compute in; set its precision to one of {TRAIN_PRECISIONS}"
            )
        if train.given("precision") and train.precision != precision:
            raise ValueError(
                f"{par.origin} and train.precision = {train.precision!r} (the plan: {precision!r}) disagree: "
                "the plan file decides the precision; remove train.precision, or parallel.plan"
            )
        train._fill("precision", precision)

    def auto_plan(self, world_size: int) -> Any:
        """With `parallel.mode = "auto"`: the planner's choice on `world_size` devices
        (`loom.train.autoplan.AutoPlan`, made once per world size), adopted into `[parallel]`."""
        if self.parallel.mode != "auto":
            raise ValueError("TrainConfig.auto_plan: parallel.mode is not 'auto'")
        if world_size not in self._planned:
            from loom.train.autoplan import choose  # the planner: only for mode = "auto"

            self._planned[world_size] = choose(self, world_size)
        chosen = self._planned[world_size]
        self.parallel.adopt(
            chosen.plan, f"the planner (parallel.mode = 'auto', {world_size} devices)", replace=True
        )
        return chosen

    def validate(self, world_size: int | None = None) -> TrainConfig:
        """Check the rules that span sections; with `world_size`, also the mesh and the batch split (with
        `parallel.mode = "auto"`, on the plan the planner chooses for `world_size`: `auto_plan`).

        Returns self, so that `cfg = load_config(...).validate(world_size)` reads naturally.
        """
        if self.parallel.mode == "auto" and world_size is not None:
            self.auto_plan(world_size)
        return self.check_rules(world_size)

    def check_rules(self, world_size: int | None = None) -> TrainConfig:
        """`validate` on the [parallel] values as they stand (the planner's candidates are checked so)."""
        model, data = self.model, self.data
        if data.seq_len > model.max_seq_len:
            raise ValueError(
                f"data.seq_len = {data.seq_len} exceeds model.max_seq_len = {model.max_seq_len}; "
                "raise model.max_seq_len or lower data.seq_len"
            )
        try:
            data.check_vocab(model.vocab_size)
        except ValueError as error:
            if not model.is_hf:
                raise
            raise ValueError(
                f"{error}; with a Hugging Face model, model.vocab_size is the vocab_size of its config.json "
                f"({model.hf_config or model.hf_pretrained}): change it there"
            ) from None
        try:
            self._check_parallel(world_size)
        except ValueError as error:  # one a plan file's values broke: say so
            raise self.parallel.from_origin(error) from None
        return self

    def _check_parallel(self, world_size: int | None) -> None:
        """The rules of `[parallel]` against the model, the data and the batch (`validate`)."""
        model, data, par = self.model, self.data, self.parallel
        if model.is_hf:
            self._check_hf_parallel(world_size)
        cut_over_tp = (
            ("model.n_heads", model.n_heads),
            ("model.n_kv_heads (kv heads)", model.kv_heads),
            ("model.d_ff (MLP size)", model.ffn_dim),
            ("model.vocab_size (the embedding is cut by rows)", model.vocab_size),
        )
        for what, size in cut_over_tp:
            if size % par.tp:
                divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
                raise ValueError(
                    f"parallel.tp = {par.tp} must divide {what} = {size}; choose tp in {divisors} "
                    f"or change {what.split(' ')[0]}"
                )
        # with cp each rank holds seq_len / cp tokens of a sequence, which sequence parallelism cuts over tp
        if par.sequence_parallel and par.tp > 1 and data.seq_len % (par.tp * par.cp):
            within = f" x parallel.cp = {par.cp}" if par.cp > 1 else ""
            raise ValueError(
                f"parallel.sequence_parallel cuts data.seq_len = {data.seq_len} over parallel.tp = {par.tp}"
                f"{within}; use a seq_len divisible by {par.tp * par.cp} or set sequence_parallel = false"
            )
        if par.pp > model.n_layers:
            raise ValueError(f"parallel.pp = {par.pp} exceeds model.n_layers = {model.n_layers}; lower pp")
        self._check_context()
        self.check_pipeline()
        dp = par.dp_size(world_size) if world_size is not None else (None if par.dp == -1 else par.dp)
        self.check_replicas(dp)
        self.check_elastic(dp)
        if not model.is_hf:  # a Hugging Face model's experts: `_check_hf_experts`
            model.gpt_config().check_expert_parallel(par.ep, dp)
        if dp is not None:
            self._check_batch_split(dp)

    def _check_context(self) -> None:
        """With `parallel.cp > 1`: the sequence must cut evenly and, for Ulysses, the heads too."""
        model, data, par = self.model, self.data, self.parallel
        if par.cp == 1:
            return
        # the GPT cuts for ring attention head-tail (2 * cp chunks), for Ulysses contiguously (cp chunks):
        # `Strategies.sequence_layout`, `loom.parallel.context.chunk_count` (not imported here: no torch)
        chunks = 2 * par.cp if par.attention == "ring" else par.cp
        if data.seq_len % chunks:
            raise ValueError(
                f"parallel.cp = {par.cp} with {par.attention} attention cuts data.seq_len = {data.seq_len} into "
                f"{chunks} equal chunks; use a seq_len divisible by {chunks}"
            )
        if par.attention == "ulysses" and model.n_heads % (par.tp * par.cp):
            raise ValueError(
                f"parallel.attention = 'ulysses' cuts each tp rank's heads over cp: tp * cp = {par.tp * par.cp} "
                f"must divide model.n_heads = {model.n_heads}; use attention = 'ring' or a smaller cp"
            )

    def _check_hf_parallel(self, world_size: int | None) -> None:
        """What `[parallel]` cannot do with a Hugging Face model through `loom train` yet (some rules need
        the data-parallel size: checked once `world_size` is known, or `parallel.dp` set)."""
        par, model = self.parallel, self.model
        if par.cp > 1:
            self._check_hf_context()
        if par.tp > 1 and par.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel: the tensor-parallel plans of Hugging Face models do not cut the "
                "sequence yet; set sequence_parallel = false"
            )
        if par.pp > 1 and par.tp > 1 and model.tie_embeddings:
            source = model.hf_config or str(Path(model.hf_pretrained or "") / "config.json")
            raise ValueError(
                f"parallel.pp = {par.pp} with parallel.tp = {par.tp}: the model's head is tied to its token "
                f"table (tie_word_embeddings in {source}), and a table tied between pipeline stages is not "
                "laid out tensor-parallel yet; set parallel.tp = 1, or parallel.pp = 1, or untie it "
                '("tie_word_embeddings": false in its config.json)'
            )
        if par.ep > 1:
            self._check_hf_experts(world_size)
        if par.pp > 1:
            self._check_hf_pipeline()

    def _check_hf_context(self) -> None:
        """`parallel.cp > 1` on a Hugging Face model: no pipeline (its stages do not cut sequences), its
        family's recipe names its attention modules, and its config asks for nothing that a sequence cut
        over cp cannot run (a sliding window, attention dropout); `loom.parallel.hf_context` refuses the
        same at run time."""
        from loom.models.hf import causal_lm_class
        from loom.models.recipes import RECIPES
        from loom.parallel.hf_context import check_context_config

        par, model = self.parallel, self.model
        source = model.hf_config or str(Path(model.hf_pretrained or "") / "config.json")
        if par.pp > 1:
            raise ValueError(
                f"parallel.cp = {par.cp} with parallel.pp = {par.pp}: the pipeline stages of a Hugging Face "
                "model do not cut its sequences (loom's GPT only); set parallel.cp = 1 or parallel.pp = 1"
            )
        hf_config = model.hf_model_config()
        name = causal_lm_class(hf_config)
        modules = getattr(RECIPES.get(name), "attention", None)
        check_context_config(hf_config, name, modules, cp=par.cp, key="parallel.cp", source=source)

    def _check_hf_experts(self, world_size: int | None) -> None:
        """`parallel.ep > 1` on a Hugging Face model: its family's recipe names its experts (Mixtral), `ep`
        divides their number and is made of the innermost factors of dp (with a pipeline: each stage's)."""
        from loom.models.hf import causal_lm_class
        from loom.models.moe import check_expert_split
        from loom.models.recipes import RECIPES

        par, model = self.parallel, self.model
        hf_config = model.hf_model_config()
        name = causal_lm_class(hf_config)
        recipe = RECIPES.get(name)
        if getattr(recipe, "experts", None) is None:
            known = sorted(n for n, r in RECIPES.items() if getattr(r, "experts", None) is not None)
            raise ValueError(
                f"parallel.ep = {par.ep}: loom knows no experts module in {name} (families with experts: "
                f"{known}); set parallel.ep = 1"
            )
        dp = par.dp_size(world_size) if world_size is not None else (None if par.dp == -1 else par.dp)
        check_expert_split(
            par.ep, hf_config.num_local_experts, dp, ep_name="parallel.ep",
            experts_name=f"num_local_experts in {model.hf_config or model.hf_pretrained}",
        )  # fmt: skip

    def _check_hf_pipeline(self) -> None:
        """A Hugging Face model cut into pipeline stages needs its family's recipe (where its embeddings,
        blocks and head are: `loom.models.recipes`), and a loss that the last stage computes alone."""
        from loom.models.hf import causal_lm_class
        from loom.models.recipes import RECIPES

        model, pp = self.model, self.parallel.pp
        source = model.hf_config or str(Path(model.hf_pretrained or "") / "config.json")
        hf_config = model.hf_model_config()
        name = causal_lm_class(hf_config)
        if name not in RECIPES:
            known = sorted(n for n in RECIPES if n != "GPT")
            raise ValueError(
                f"parallel.pp = {pp}: loom has no pipeline recipe for {name} (model_type "
                f"{hf_config.model_type!r} in {source}; recipes: {known}); use parallel.pp = 1 (data and "
                "tensor parallel), or cut it in Python with loom.parallel.pipeline.model_pipeline(model, "
                "mesh, recipe=Recipe(...))"
            )
        if getattr(hf_config, "output_router_logits", False):
            raise ValueError(
                f"parallel.pp = {pp}: {source} sets output_router_logits = true, whose auxiliary router "
                'loss pipeline stages do not compute; set "output_router_logits": false there, or use '
                "parallel.pp = 1"
            )

    def check_replicas(self, dp: int | None = None) -> None:
        """With `parallel.sync` other than "every_step": a ValueError for each setting that replicas stepping
        alone refuse, saying how to fix it (`dp`: the data-parallel size, when known). A replica may be
        data-parallel (`parallel.replicas` < dp, its optimizer level sharding over its own dp ranks),
        pipelined and tensor-parallel inside; nothing else cuts it."""
        par, model = self.parallel, self.model
        if not par.replicas_step_alone:
            return
        if par.replicas != -1 and par.replicas < 1:
            par._fail("replicas", "use a positive divisor of parallel.dp, or -1 for one replica per dp index")
        refused = (
            ("parallel.cp", par.cp, 1, "context-parallel ranks do not step alone yet"),
            ("parallel.ep", par.ep, 1, "experts cut over dp ranks need every replica at each step"),
            ("model.experts", model.experts, 1, "the experts' balancing is not kept per replica yet"),
        )
        _refuse(refused, f"parallel.sync = {par.sync!r}", "parallel.sync = 'every_step'")
        if model.is_hf:
            raise ValueError(
                f"parallel.sync = {par.sync!r} trains loom's GPT; a Hugging Face model (model.hf_config / "
                "hf_pretrained) syncs every step yet: set parallel.sync = 'every_step'"
            )
        if dp is not None and dp % par.replica_count(dp):
            raise ValueError(
                f"parallel.replicas = {par.replicas} must divide parallel.dp = {dp}: each replica holds dp / "
                f"replicas data-parallel ranks; choose replicas in "
                f"{[d for d in range(1, dp + 1) if dp % d == 0]} or -1 (one replica per dp index)"
            )
        inside = None if dp is None else dp // par.replica_count(dp)
        if par.optimizer_level > 0 and (inside == 1 or (dp is None and par.replicas == -1)):
            raise ValueError(
                f"parallel.optimizer_level = {par.optimizer_level} with parallel.sync = {par.sync!r} shards over "
                "the data-parallel ranks inside each replica, and with parallel.replicas = "
                f"{par.replicas} (dp = {dp if dp is not None else par.dp}) a replica has one: set "
                "parallel.replicas to a divisor of dp below it (e.g. dp / 2), or optimizer_level = 0"
            )

    def check_elastic(self, replicas: int | None = None) -> None:
        """With `fault.elastic_replicas`: a ValueError for each setting replicas that come and go refuse
        (`replicas`: the data-parallel size, when known)."""
        par = self.parallel
        if not self.fault.elastic_replicas:
            return
        if not par.replicas_step_alone:
            raise ValueError(
                "fault.elastic_replicas = true drops a dead replica from the next sync: it needs parallel.sync "
                "= 'local_sgd' or 'diloco' (with every_step sync a death stays a restart); set one, or "
                "fault.elastic_replicas = false"
            )
        several = "a replica of several processes does not leave whole yet"
        refused = (
            ("parallel.tp", par.tp, 1, several),
            ("parallel.pp", par.pp, 1, several),
            # replicas = dp is one process per replica, as -1 is
            ("parallel.replicas", -1 if par.replicas == replicas else par.replicas, -1, several),
            ("parallel.optimizer_level", par.optimizer_level, 0, "replicas of one process shard nothing"),
            ("parallel.fragments", par.fragments, 1, "fragments do not meet elastically yet"),
            ("parallel.fragment_delay", par.fragment_delay, 0, "delays do not meet elastically yet"),
        )
        _refuse(refused, "fault.elastic_replicas = true", "fault.elastic_replicas = false")
        if replicas is not None and replicas < 2:
            raise ValueError(
                f"fault.elastic_replicas = true with {replicas} replica (parallel.dp): a replacement takes the "
                "global weights from a replica that lived through the death, so it needs at least two; run "
                "on more workers, or set fault.elastic_replicas = false"
            )
        if self.checkpoint.dir:
            raise ValueError(
                f"checkpoint.dir = {self.checkpoint.dir!r} with fault.elastic_replicas = true: checkpoints of "
                "replicas that come and go are not written yet; leave checkpoint.dir empty or set "
                "fault.elastic_replicas = false"
            )

    def check_pipeline(self) -> None:
        """With `parallel.pp > 1`: a ValueError for each setting that pipelines refuse, saying how to fix it.
        The one place these rules live: `validate` calls it, so `loom train` reports them before it starts
        any worker, and the job calls `validate` again on its mesh."""
        par, model = self.parallel, self.model
        if par.pp == 1:
            return
        virtual = par.to_plan().virtual_stages  # micro-batches against pp: a rule of the Plan
        if par.stages is not None and sum(par.stages) != model.n_layers:
            raise ValueError(
                f"parallel.stages = {list(par.stages)} holds {sum(par.stages)} blocks but the model has "
                f"{model.n_layers} layers; give counts that add up to {model.n_layers}"
            )
        if model.n_layers < par.pp * virtual:
            raise ValueError(
                f"parallel.pp = {par.pp}: schedule {par.schedule!r} puts {virtual} stages on each of {par.pp} "
                f"ranks but the model has {model.n_layers} layers; raise model.n_layers or lower pp"
            )

    def plan(self, world_size: int) -> Plan:
        """The Plan `loom train` runs on `world_size` devices: `[parallel]` (or its plan file, or the
        planner's choice with `mode = "auto"`) with `train.precision`, the data-parallel size filled in."""
        if self.parallel.mode == "auto":
            self.auto_plan(world_size)
        return self.parallel.to_plan(world_size, precision=self.train.precision)

    @property
    def accumulation(self) -> int:
        """Micro-batches the Trainer runs per optimizer step: `train.grad_accum`, times the plan's
        micro-batches without a pipeline (a plan from `loom plan` or the planner may accumulate; a pipeline
        runs its micro-batches inside each of the `grad_accum` schedule runs)."""
        par = self.parallel
        return self.train.grad_accum * (par.to_plan().micro_batches if par.pp == 1 else 1)

    def cost_model(self, world_size: int) -> tuple[TransformerConfig, ParallelPlan]:
        """The model and plan as the simulator prices this run on `world_size` devices: one optimizer step
        of `train.global_batch` sequences of `data.seq_len` tokens, `train.grad_accum` micro-steps; loom's GPT
        with `model.attention_kernel = "sdpa"` priced with fused attention (no s x s scores stored)."""
        self.validate(world_size)
        fused = not self.model.is_hf and self.model.attention_kernel == "sdpa"
        run = self.plan(world_size).parallel_plan(
            global_batch=self.train.global_batch, seq=self.data.seq_len, accumulation=self.train.grad_accum,
            flash_attention=fused,
        )  # fmt: skip
        return self.model.transformer_config(), run

    def check_files(self) -> TrainConfig:
        """Check the paths the run reads and writes, before any worker starts: `data.path` is a readable file
        (of whole ids for tokens), and `checkpoint.dir`, `train.tensorboard_dir` and the directory of
        `train.metrics_file` are (or can be created as) writable directories. Returns self."""
        if self.data.kind != "arithmetic" and self.data.path is not None:
            from loom.train.data import check_data_file

            check_data_file(self.data.kind, self.data.path, self.data.dtype)
        for key, directory in (
            ("checkpoint.dir", self.checkpoint.dir),
            ("train.tensorboard_dir", self.train.tensorboard_dir),
        ):
            if directory is not None:
                _check_writable_dir(key, Path(directory))
        if self.train.metrics_file is not None:
            path = Path(self.train.metrics_file)
            if path.is_dir():
                raise ValueError(
                    f"train.metrics_file = {str(path)!r} is a directory; name a file, e.g. {str(path / 'metrics.jsonl')!r}"
                )
            _check_writable_dir("train.metrics_file", path.parent, of=str(path))
        return self

    def preflight(self, world_size: int) -> TrainConfig:
        """Everything that can be checked before workers start: `validate(world_size)` and `check_files`."""
        return self.validate(world_size).check_files()

    def _check_batch_split(self, dp: int) -> None:
        train, par, steps = self.train, self.parallel, self.accumulation
        if train.global_batch % (dp * steps):
            shown = (
                "grad_accum"
                if steps == train.grad_accum
                else "micro-steps (grad_accum x the plan's micro_batches)"
            )
            raise ValueError(
                f"train.global_batch = {train.global_batch} is not divisible by dp * {shown} = "
                f"{dp} * {steps}; use a multiple of {dp * steps}"
            )
        rows = train.global_batch // (dp * steps)
        if par.pp > 1 and rows % par.microbatches:
            raise ValueError(
                f"a micro-batch step of {rows} rows per data-parallel rank is not divisible by "
                f"parallel.microbatches = {par.microbatches}; change global_batch or microbatches"
            )


def _check_writable_dir(key: str, path: Path, of: str | None = None) -> None:
    """`path` is a directory this process can write in, or can be created as one: a ValueError naming `key`
    otherwise (an existing file in the way, no permission)."""
    shown = f"{key} = {of or str(path)!r}"
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{shown}: {str(path)!r} is an existing file, not a directory; point {key} at a directory "
            "(created if missing) or move the file away"
        )
    existing = path
    while not existing.exists():  # the nearest ancestor that exists decides whether it can be created
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{shown}: {str(existing)!r} is a file, so the directory cannot be created there; "
            f"choose another path for {key}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{shown}: no permission to write in {str(existing)!r}; choose a directory you can write to "
            f"or change its permissions"
        )


def config_help() -> str:
    """Every TOML key with its default and description, by section: what `loom train --help` lists
    (generated from the section dataclasses, so it never disagrees with them)."""
    lines = []
    for name, cls in _SECTIONS.items():
        lines.append(f"[{name}]")
        for item, hint in zip(dataclasses.fields(cls), cls.field_types().values(), strict=True):
            default = _jsonable(item.default)
            shown = (
                "none" if default is None else str(default).lower() if isinstance(default, bool) else default
            )
            text = item.metadata.get("help", "")
            if get_origin(hint) is Literal:
                text += f" ({' | '.join(get_args(hint))})"
            lines.append(f"  {f'{name}.{item.name} = {shown}':<38} {text}")
    return "\n".join(lines)


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
    # `loom train --parallel.tp 4 CONFIG.toml`: the command line took `4` for the file
    misplaced = any(str(o).endswith(".toml") for o in overrides)
    hint = " (the --section.key overrides go after CONFIG.toml)" if misplaced else ""
    if path is not None:
        where = str(path)
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except FileNotFoundError:
            raise ValueError(f"config file {where!r} does not exist{hint}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {where!r} is not valid TOML: {exc}") from None
    try:
        parsed = parse_overrides(overrides)
    except ValueError as exc:
        raise ValueError(f"{exc}{hint}") from None
    for section, values in parsed.items():
        table = data.setdefault(section, {})
        if isinstance(table, dict):
            table.update(values)
    return TrainConfig.from_dict(data, where)
