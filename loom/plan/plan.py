"""`Plan`: everything that decides how a model trains on many devices, as plain data saved as JSON.

A TOML `[parallel]` section compiles to one (`TrainConfig.plan`), the simulator prices one
(`Plan.parallel_plan`), checkpoints store one in `plan.json`, and a planner may write one with its
predicted step time and memory. Every rule is checked once, in `__post_init__`; a `-1` data-parallel size
is filled in against a world size by `resolve`. Nothing here executes anything.

    plan = Plan(dp=-1, tp=2, pp=2, micro_batches=4, optimizer_level=1).resolve(8)
    plan.save("plan.json"); assert Plan.load("plan.json") == plan
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.cost.plan import (
    ATTENTIONS,
    OPTIMIZER_LEVELS,
    PRECISIONS,
    RECOMPUTE,
    SIMULATED_SCHEDULES,
    FieldError,
    ParallelPlan,
    check_choice,
    check_schedule,
    check_sizes,
    default_schedule,
)
from loom.cost.traffic import StepCollective, step_collectives
from loom.cost.transformer import TransformerConfig
from loom.plan.specs import (
    MESH_AXES,
    OWNER,
    check_layouts,
    check_recompute_modules,
    check_stages,
    check_strategies,
)

__all__ = ["Plan"]


def plain_data(value: Any) -> Any:
    """JSON's own shapes (tuples as lists), so that a Plan equals itself read back from JSON."""
    if isinstance(value, dict):
        return {key: plain_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(item) for item in value]
    return value


def _json_text(value: Any, indent: str = "") -> str:
    """JSON with one table entry per line and lists written on one line: short, and diffable."""
    if not isinstance(value, dict) or not value:
        return json.dumps(value)
    inner = indent + "  "
    lines = [f"{inner}{json.dumps(key)}: {_json_text(item, inner)}" for key, item in value.items()]
    return "{\n" + ",\n".join(lines) + "\n" + indent + "}"


# a plan's own layouts, apart from the Megatron layouts of the models' recipes
LAYOUT_KEYS = (
    "strategies",
    "parameter_layouts",
    "compute_layouts",
    "input_layouts",
    "primitives_follow_inputs",
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How one model trains: mesh sizes, layouts and strategies by module pattern, pipeline, memory
    policies and precision, and what a planner predicted for it.

    Mesh: `dp`, `tp`, `pp`, `ep` (experts, carved out of dp) and `cp` (context); `dp = -1` takes the
    devices the others leave (see `resolve`). `attention`: how attention spans a sequence cut over cp
    (one of `ATTENTIONS`: "ulysses", all-to-alls of heads; "ring", key/value blocks passed around).
    Pipeline: `schedule` (one of `SCHEDULES`), `virtual_stages` model chunks per pipeline rank, `micro_batches` per schedule run, and optionally `stages`, the
    `pp * virtual_stages` stages as blocks per stage or module paths per stage (uneven allowed).
    `strategies`: module pattern -> {"in_strategy", "out_strategy", "parameter_plan"} (MindSpore's `shard`
    arguments as JSON lists); `parameter_layouts`: parameter pattern -> tensor spec (see `loom.plan.specs`);
    `compute_layouts`: parameter pattern -> the tensor spec its module's forward reads it in, where that
    differs from where it is kept (an automatic plan's weight kept cut over dp and gathered to compute).
    `input_layouts`: the name of an argument of the model's `forward` -> the tensor spec the forward reads
    that input in, where it differs from how a batch arrives (rows cut over dp): an automatic plan's batch
    gathered where the planner priced gathering it.
    `primitives_follow_inputs`: the model's `loom.ops` primitives set their own strategies aside and compute
    on their inputs as those arrive, by DTensor's rules (an automatic plan's layouts are priced so: its
    parameter layouts and module strategies are the only ones); false, each primitive applies its strategy.
    `recompute` applies to every block unless `recompute_modules` names a policy for a module pattern.
    `predicted_step_s` and `predicted_memory_bytes`: what the planner that wrote the plan predicted, the
    memory being the model's own bytes per device (parameters, gradients, optimizer states, activations),
    without the device's reserved memory (runtime context, allocator slack) that `loom simulate` and
    `loom plan` add to what they print: the quantity `loom.parallelize(mode="auto", memory_limit=)` bounds.
    """

    dp: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    attention: str = "ulysses"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    stages: list | None = None
    optimizer_level: int = 0
    recompute: str = "none"
    recompute_modules: dict[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    precision: str = "fp32"
    strategies: dict[str, dict] = field(default_factory=dict)
    parameter_layouts: dict[str, list] = field(default_factory=dict)
    compute_layouts: dict[str, list] = field(default_factory=dict)
    input_layouts: dict[str, list] = field(default_factory=dict)
    primitives_follow_inputs: bool = False
    predicted_step_s: float | None = None
    predicted_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            object.__setattr__(self, item.name, plain_data(getattr(self, item.name)))
        self._check_mesh()
        self._check_pipeline()
        check_choice(OWNER, "optimizer_level", self.optimizer_level, OPTIMIZER_LEVELS)
        check_choice(OWNER, "recompute", self.recompute, RECOMPUTE)
        check_recompute_modules(self.recompute_modules)
        check_choice(OWNER, "precision", self.precision, PRECISIONS)
        for key in ("sequence_parallel", "primitives_follow_inputs"):
            if not isinstance(getattr(self, key), bool):
                raise FieldError(OWNER, key, getattr(self, key), "use true or false")
        check_strategies(self.strategies)
        check_layouts(self.parameter_layouts)
        check_layouts(self.compute_layouts, "compute_layouts")
        check_layouts(self.input_layouts, "input_layouts")
        self._check_predictions()

    def _check_mesh(self) -> None:
        if self.dp != -1 and (isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1):
            raise FieldError(
                OWNER, "dp", self.dp, "use a size >= 1, or -1 to fill the devices left by the other axes"
            )
        check_sizes(OWNER, {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp})
        check_choice(OWNER, "attention", self.attention, ATTENTIONS)
        if self.dp != -1 and self.dp % self.ep:
            raise FieldError(
                OWNER, "ep", self.ep, f"experts shard the data-parallel axis: divide dp = {self.dp}"
            )

    def _check_pipeline(self) -> None:
        check_sizes(OWNER, {"virtual_stages": self.virtual_stages, "micro_batches": self.micro_batches})
        check_schedule(OWNER, self.schedule, self.virtual_stages)
        if self.pp > 1 and self.micro_batches < self.pp:
            raise FieldError(
                OWNER,
                "micro_batches",
                self.micro_batches,
                f"{self.micro_batches} micro-batches for {self.pp} pipeline stages never fill the "
                f"pipeline; use >= {self.pp} (4x the stages keeps the bubble small)",
            )
        if self.stages is not None:
            check_stages(self.stages, self.pp * self.virtual_stages)

    def _check_predictions(self) -> None:
        for key in ("predicted_step_s", "predicted_memory_bytes"):
            value = getattr(self, key)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and value > 0):
                raise FieldError(OWNER, key, value, "use a positive number, or leave it out")

    def __hash__(self) -> int:  # its tables are dicts: hash the JSON, which equal plans share
        return hash(self.to_json())

    # ---- mesh ----
    @property
    def resolved(self) -> bool:
        """True when every mesh size is known (`dp` is not -1)."""
        return self.dp != -1

    def resolve(self, world_size: int) -> Plan:
        """This plan on `world_size` devices: `dp = -1` filled in, and dp * cp * tp * pp checked against it."""
        check_sizes(OWNER, {"world_size": world_size})
        rest = self.tp * self.pp * self.cp
        dp = world_size // rest if self.dp == -1 else self.dp
        if dp < 1 or dp * rest != world_size:
            raise FieldError(
                OWNER,
                "dp",
                self.dp,
                f"dp * tp * pp * cp = {self.dp} * {self.tp} * {self.pp} * {self.cp} does not fill "
                f"{world_size} devices; make the product {world_size} (dp = -1 fills in)",
            )
        return self.replace(dp=dp)

    @property
    def world_size(self) -> int:
        """Devices the plan uses (a resolved plan only)."""
        self._require_resolved("world_size")
        return self.dp * self.cp * self.tp * self.pp

    def mesh_sizes(self) -> dict[str, int]:
        """Axis sizes for `loom.init`, outermost first (pp, dp, cp, tp: tp innermost, on the fastest
        links); axes of size 1 other than dp are left out, and ep lives inside dp."""
        self._require_resolved("mesh_sizes")
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES if axis != "ep"}
        return {axis: size for axis, size in sizes.items() if size > 1 or axis == "dp"}

    def _require_resolved(self, what: str) -> None:
        if not self.resolved:
            raise ValueError(f"Plan.{what}: dp = -1 is not resolved yet; call plan.resolve(world_size) first")

    # ---- the simulator's view ----
    def parallel_plan(
        self,
        *,
        global_batch: int,
        seq: int,
        accumulation: int = 1,
        flash_attention: bool = False,
        overlap_grad_sync: bool = True,
    ) -> ParallelPlan:
        """What the simulator prices for one optimizer step of `global_batch` sequences of `seq` tokens.

        A step runs `accumulation` times `micro_batches` micro-batches per data-parallel replica; the
        simulator plays them as one schedule (a pipelined run with accumulation flushes between its
        schedule runs, so it takes a little longer than priced). Strategies, parameter layouts and
        per-module recompute are not priced: the simulator prices Megatron's layouts over tp. Stages given
        as blocks per stage are priced as they are (uneven included). `cp` and `attention` are priced as
        loom's GPT runs them (`loom.sim.simulator`).
        """
        return self._step_plan(global_batch, seq, accumulation, flash_attention, overlap_grad_sync)

    def _step_plan(
        self, global_batch: int, seq: int, accumulation: int, flash_attention: bool, overlap_grad_sync: bool
    ) -> ParallelPlan:
        """`parallel_plan` with the fields a caller may leave to their defaults given."""
        self._require_resolved("parallel_plan")
        check_sizes(OWNER, {"global_batch": global_batch, "seq": seq, "accumulation": accumulation})
        per_step = self.dp * self.micro_batches * accumulation
        if global_batch % per_step:
            raise ValueError(
                f"global batch {global_batch} does not split into dp * micro_batches * accumulation = "
                f"{self.dp} * {self.micro_batches} * {accumulation} micro-batches; use a multiple of {per_step}"
            )
        return ParallelPlan(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            interleave=self.virtual_stages,
            ep=self.ep,
            micro_batch=global_batch // per_step,
            global_batch=global_batch,
            seq=seq,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
            optimizer_level=self.optimizer_level,
            schedule=self.schedule,
            overlap_grad_sync=overlap_grad_sync,
            flash_attention=flash_attention,
            dtype=self.precision,
            stage_layers=self._stage_layers(),
            cp=self.cp,
            attention=self.attention,
        )

    def _check_megatron(self, what: str) -> None:
        """Refuse `what` (a prediction that assumes the Megatron layouts) for a plan carrying layouts of its own."""
        own = [key for key in LAYOUT_KEYS if getattr(self, key)]
        if own:
            raise ValueError(
                f"Plan.{what}: this plan sets {own[0]}, so the Megatron layouts it predicts with are not the "
                f"ones it applies; for an automatic plan read model.loom.predicted_collectives after "
                f"loom.parallelize(model, mode='auto'), or leave {', '.join(own)} unset"
            )

    def _stage_layers(self) -> tuple[int, ...]:
        """Blocks per stage when `stages` gives them as counts (the simulator prices uneven stages);
        stages given as module paths are priced as equal."""
        if self.stages and all(isinstance(n, int) for n in self.stages):
            return tuple(self.stages)
        return ()

    def predicted_collectives(
        self,
        model: TransformerConfig,
        *,
        global_batch: int,
        seq: int,
        bucket_mb: float = 25.0,
        inputs: int = 2,
        counted_loss: bool = True,
        pp_rank: int = 0,
        accumulation: int = 1,
    ) -> list[StepCollective]:
        """The collectives one training step of `model` (a `TransformerConfig`: `transformer_config` for
        loom's GPT, `hf_transformer_config` for a Hugging Face model) issues on one rank under this plan,
        with its Megatron layouts (`loom.models.recipes.tensor_plan`): see `loom.cost.traffic`.
        `global_batch` sequences of `seq` tokens, `micro_batches` per replica (one without a pipeline);
        `bucket_mb` as given to `loom.parallelize` or the pipeline; `inputs` tensors to the forward;
        `counted_loss`: a mean over counted targets (Hugging Face's loss) rather than a plain mean (loom's
        GPT). With pp > 1, one `Trainer` step on a rank of pipeline rank `pp_rank` (the pipeline ranks
        differ: the first embeds, the last computes the loss), under any of loom's schedules, in
        `accumulation` pipeline runs of `micro_batches` each (a `Trainer` step of that many micro-batches).

        Refused for a plan carrying its own layouts (`strategies`, `parameter_layouts`, `compute_layouts`,
        `input_layouts`, `primitives_follow_inputs`: an automatic plan's), which the Megatron layouts do not
        describe: `loom.parallelize(mode="auto")` predicts such a plan's step from its solution, in
        `model.loom.predicted_collectives`; a plan applied again (`plan=`, or read from JSON) carries no
        prediction."""
        self._check_megatron("predicted_collectives")
        # the simulator plays only some schedules; the prediction takes the plan's, on a plan of its shape
        played = self.schedule in SIMULATED_SCHEDULES
        shape = self if played else self.replace(schedule=default_schedule(self.virtual_stages))
        return step_collectives(
            model,
            shape._step_plan(global_batch, seq, accumulation, False, True),
            bucket_mb=bucket_mb,
            inputs=inputs,
            counted_loss=counted_loss,
            pp_rank=pp_rank,
            schedule=self.schedule,
            accumulation=accumulation,
        )

    # ---- plain data and JSON ----
    def replace(self, **changes: Any) -> Plan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, every field in declaration order (a copy: changing it leaves the plan alone)."""
        return {item.name: copy.deepcopy(getattr(self, item.name)) for item in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the plan") -> Plan:
        """A plan from `to_dict`'s data; an unknown key is a ValueError naming the closest known one."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object of plan fields, got {type(data).__name__}")
        known = [item.name for item in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"unknown plan field {key!r} in {where}{hint}; valid fields: {', '.join(known)}"
                )
        return cls(**data)

    def to_json(self) -> str:
        """JSON text, one field per line in a fixed order, so that two plans diff line by line."""
        return _json_text(self.to_dict()) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "the plan") -> Plan:
        """A plan from `to_json`'s text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
        return cls.from_dict(data, where)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON to `path`; returns the path."""
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by `save` (a ValueError naming the file when it is missing or broken)."""
        try:
            text = Path(path).read_text()
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as exc:
            raise ValueError(f"plan file {str(path)!r} cannot be read ({exc}); give a plan.json") from None
        return cls.from_json(text, f"plan file {str(path)!r}")

    @classmethod
    def read(cls, path: str | Path) -> Plan:
        """A plan file (`save`), or a checkpoint's plan.json, whose "plan" entry is the run's Plan (a
        ValueError naming the file when it is missing or broken)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return cls.load(path)  # which says what is wrong with the file
        if isinstance(data, dict) and isinstance(data.get("plan"), dict):
            return cls.from_dict(data["plan"], f"the plan of checkpoint file {str(path)!r}")
        return cls.from_dict(data, f"plan file {str(path)!r}")
