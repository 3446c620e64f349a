"""`loom.parallelize`: a whole model in data-parallel or semi-automatic (strategy-driven) mode.

The order of transforms, fixed:
1. (semi_auto) a dry run on the meta device records which parameters feed which sharded operator inputs;
2. each parameter is laid out as its first consumer's strategy says (`parameter_plan` overrides), the others
   replicated, so that each rank keeps only its shards;
3. inputs become global DTensors: each rank's local batch (global batch = local batches concatenated on
   dim 0), or the whole batch on every rank with `full_batch=True`;
4. gradients that replicas computed in parts are reduced by bucketed all-reduce overlapped with backward;
5. (semi_auto) mixtures of experts whose expert weights came out cut on their expert dim (loom's GPT with
   `Strategies(ep=...)`; a Hugging Face model's experts cut by its family's recipe under `Plan(ep=...)`,
   `expert_module_plan`) get their token exchange over the ranks of that cut (`connect_experts`).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from loom.dist import consistency
from loom.dist.context import require_mesh
from loom.dist.mesh import Mesh
from loom.layout import compile_inputs
from loom.layout.named import on_mesh_axes
from loom.layout.parameters import lay_out_parameters, materialize
from loom.layout.redistribute import layout_of
from loom.layout.tensor_layout import TensorLayout
from loom.models.recipes import known_recipe
from loom.ops.primitive import bind_primitives
from loom.ops.trace import Recording, record
from loom.parallel.auto import auto_plan, global_meta, read_in_compute_layouts, read_inputs_in
from loom.parallel.batch_check import BatchRows, check_even_batches
from loom.parallel.experts import connect_experts, expert_module_plan
from loom.parallel.grad_sync import GradSync
from loom.parallel.hf_context import apply_context_parallel
from loom.parallel.lift import LiftPlainTensors
from loom.parallel.module_plan import (
    apply_module_plan,
    module_parameter_layouts,
    pattern_layouts,
    plan_for_mesh,
    recompute_modules,
    resolve_module_plan,
)
from loom.parallel.routes import data_parallel_route, dtensor_route, fix_placements
from loom.plan import Plan

MODES = ("data_parallel", "semi_auto", "auto")


@dataclass(kw_only=True)
class ParallelState:
    """What `parallelize` decided, kept on the module as `module.loom`."""

    mode: str
    mesh: Mesh
    full_batch: bool
    grad_sync: GradSync
    parameter_layouts: dict[str, TensorLayout] = field(default_factory=dict)
    consumers: dict[str, str] = field(default_factory=dict)  # parameter -> "Op input name"
    parameter_sharding: object | None = None  # set by an optimizer at level 3
    plan: Plan | None = None  # the Plan applied, when parallelize was given one
    # mode="auto": the collectives one training step issues on this rank, as the planner's solution predicts
    # them (`loom.plan.solve.Solution.predicted_collectives`)
    predicted_collectives: list | None = None
    batch_dims: tuple[int, ...] = ()  # semi_auto: the canonical mesh dims that cut the batch

    def distribute(self, *tensors: torch.Tensor) -> Any:
        """Plain tensors laid out as the model's inputs are (semi_auto; data_parallel: unchanged): a local
        batch becomes its rows of the global batch. For a target outside the model, whose output is a global
        DTensor: `loss = ((out - model.loom.distribute(y)) ** 2).mean()` (`out - y` is torch's "mixed
        torch.Tensor and DTensor" error)."""
        if self.mode == "semi_auto":
            tensors = _distribute_inputs(tensors, {}, self.mesh, self.batch_dims)[0]
        return tensors[0] if len(tensors) == 1 else tensors

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter whole in memory inside the block (at optimizer level 3 they are sharded at rest)."""
        if self.parameter_sharding is None:
            yield
            return
        with self.parameter_sharding.full_parameters():
            yield

    def materialize(self, module: nn.Module, device: str | torch.device = "cpu") -> None:
        """Allocate a model parallelised on the meta device (this rank's shards only, uninitialised) and
        hook its new parameters; initialise them afterwards."""
        materialize(module, device)
        self.grad_sync.attach(module)
        if self.mode == "semi_auto":
            self.grad_sync.after_sync = fix_placements([p for p in module.parameters() if p.requires_grad])

    def no_sync(self):
        """Skip gradient synchronisation inside the block (for gradient accumulation)."""
        return self.grad_sync.no_sync()

    def describe(self) -> str:
        """The plan, one line per parameter: layout and the operator input it follows."""
        names, shape = self.mesh.device_mesh.mesh_dim_names, self.mesh.canonical_shape
        lines = [f"{self.mode} on {self.mesh}" + (", full batch" if self.full_batch else "")]
        for name, layout in self.parameter_layouts.items():
            source = self.consumers.get(name, "replicated")
            lines.append(f"  {name}: {layout.describe(names, shape)}  <- {source}")
        return "\n".join(lines)


def parallelize(
    model: nn.Module,
    mode: str | None = None,
    example_inputs: Sequence[Any] | None = None,
    full_batch: bool = False,
    parameter_plan: dict[str, Any] | None = None,
    bucket_mb: float = 25.0,
    example_kwargs: dict[str, Any] | None = None,
    batch_axes: str | Sequence[str] | None = None,
    module_plan: dict[str, Any] | None = None,
    plan: Plan | str | Path | None = None,
    memory_limit: float | None = None,
    cluster: str = "h100-sxm",
) -> nn.Module:
    """Make `model` train on every rank of the current mesh; returns the same module, changed in place.

    `data_parallel`: each rank runs the whole model on its local batch, gradients are averaged (DDP's
    semantics). `semi_auto`: loom.ops primitives with strategies shard their operands; `example_inputs`
    and `example_kwargs` (each rank's local batch, or the whole batch with `full_batch=True`) drive the dry
    run that lays out the parameters; operators without a strategy run data parallel; outputs are global DTensors (`loom.full`).
    The decisions are in `model.loom` (`model.loom.describe()`).

    `batch_axes` (semi_auto): the mesh axes whose ranks bring different parts of the batch (default `"dp"`,
    and `"cp"`, whose ranks bring different pieces of the sequences);
    the ranks along the other axes must bring the same rows. `()` on a mesh without a batch axis: every
    rank brings the same whole batch. A mesh without a `"dp"` axis needs it (or `full_batch=True`).
    The ranks' agreement (strategies, replicated inputs) is checked on the first forward: see
    `loom.dist.consistency` and docs/consistency.md.

    `module_plan` (semi_auto) gives the model's own modules strategies by path pattern, for any model (no
    `loom.ops` needed): see `loom.parallel.module_plan`. Without `example_inputs` no dry run is made, and
    the parameters are laid out by `module_plan` and `parameter_plan` alone (the others replicated).

    `plan` (a `loom.plan.Plan`, or the path of its JSON) is applied as is, in a fixed order: its mesh must
    be the current one; its `strategies` are the module plan and its `parameter_layouts` the parameter plan
    (by pattern), its `primitives_follow_inputs` whether the model's `loom.ops` primitives apply their own
    strategies; then its `recompute_modules`; its optimizer level is read by `make_optimizer`. The mode
    defaults to `semi_auto` when a plan or a module plan is given, `data_parallel` otherwise. The plan's
    `ep` names the innermost `ep` ranks of "dp" in its strategies ("ep" in a tensor spec), and cuts a
    Hugging Face model's experts over them as its family's recipe says (Mixtral: `loom.models.recipes.
    ExpertsRecipe`), the tokens exchanged by `loom.parallel.experts`.
    `model.loom.plan` holds the plan applied.

    `auto`: the planner chooses the parameters' layouts and the modules' output strategies (the full search
    of `loom.plan.solve` on the example batch, priced on `cluster`'s hardware profile, each device keeping
    at most `memory_limit` bytes of parameters, gradients, AdamW states and activations when given), and
    the chosen Plan is applied as above (`model.loom.plan`, with its predicted step time and memory;
    `model.loom.predicted_collectives`, the collectives one training step issues on this rank).
    """
    example_inputs = _check_arguments(
        model, mode or "data_parallel", example_inputs, example_kwargs, bucket_mb
    )
    _check_auto(mode, example_inputs, example_kwargs, memory_limit, plan or module_plan or parameter_plan)
    mesh = require_mesh("loom.parallelize")
    predicted = None
    if mode == "auto":
        # the planner lays out everything: the model's loom.ops primitives (loom's GPT) set their own
        # strategies aside, in the trace and in training, and DTensor's rules carry the chosen layouts
        bind_primitives(model, mesh, follow_inputs=True)
        try:
            plan, predicted = auto_plan(model, mesh, example_inputs, example_kwargs, full_batch=full_batch,
                                        memory_limit=memory_limit, cluster=cluster, bucket_mb=bucket_mb)  # fmt: skip
        except Exception:
            # the error suggests semi_auto on the same model: its primitives lay themselves out again
            bind_primitives(model, mesh, follow_inputs=False)
            raise
        # no dry run: the plan holds every layout (and a meta run of a Hugging Face model stops on `.item()`)
        mode, example_inputs, example_kwargs = "semi_auto", None, None
    ep = 1
    if plan is not None:
        plan = plan_for_mesh(plan, mesh)
        if module_plan or parameter_plan:
            raise ValueError(
                "parallelize: give strategies either in the plan (plan.strategies, plan.parameter_layouts) or "
                "as module_plan/parameter_plan, not both"
            )
        module_plan, ep = plan.strategies, plan.ep
        parameter_plan = pattern_layouts(model, plan.parameter_layouts, mesh) or None
        # the plan says whether the model's loom.ops primitives apply their own strategies (an automatic
        # plan's were priced following their inputs), so that it runs as priced on any fresh model
        bind_primitives(model, mesh, follow_inputs=plan.primitives_follow_inputs)
    if mode is None:
        mode = "semi_auto" if plan is not None or module_plan is not None else "data_parallel"
    if plan is not None and plan.cp > 1:
        _context_parallel(model, mesh, plan)
    model = _parallelize(
        model, mesh, mode, example_inputs, full_batch, parameter_plan, bucket_mb, example_kwargs, batch_axes,
        module_plan, ep=ep,
    )  # fmt: skip
    if plan is not None:
        # the planner's parameters read in another layout than kept (gathered over dp to compute)
        computed = pattern_layouts(model, plan.compute_layouts, mesh, "plan.compute_layouts")
        read_in_compute_layouts(model, _planned(model, computed, mesh, ep, "plan.compute_layouts"), mesh)
        # after the even-batch check's hook, which makes the inputs DTensors of this rank's rows
        read_inputs_in(model, plan.input_layouts, mesh)
        recompute_modules(model, plan.recompute_modules)
        model.loom.plan = plan
    if predicted is not None:
        model.loom.predicted_collectives = predicted
    return model


def parallelize_part(
    part: nn.Module,
    mesh: Mesh,
    *,
    module_plan: dict[str, Any] | None = None,
    root: nn.Module | None = None,
    example_inputs: Sequence[Any] | None = None,
    bucket_mb: float = 25.0,
    batch_axes: str | Sequence[str] | None = None,
    check_once_per_shape: bool = False,
    ep: int = 1,
) -> nn.Module:
    """Lay out `part`, a piece of `root` (a pipeline stage, or a whole replica; default: `part` itself), on
    `mesh` in semi_auto mode: by `module_plan`, whose patterns are matched against `root`'s module paths
    (modules outside `part` are skipped), and by its primitives' strategies seen in a dry run on
    `example_inputs`. `batch_axes` as in `parallelize` (`()`: every rank of `mesh` brings the same batch, as
    the tensor-parallel ranks of one replica do). The mesh is an argument: below the API surface nothing
    reads the current mesh (the part's primitives compute on `mesh` from now on). `check_once_per_shape`:
    the even-batch check of the inputs' sizes runs once per distinct shape of the inputs, not every forward
    (for parts whose input shapes are fixed by other means, as a pipeline schedule fixes its stages'). A rank
    whose shape was checked before takes no part, so it must not change on some ranks only: a rank that
    brings a new shape while the others bring a checked one waits for them instead of failing. `ep`: the
    experts of a family with an `ExpertsRecipe` cut over the innermost `ep` ranks of "dp", as a
    `Plan(ep=...)` cuts them (`loom.parallel.experts.expert_module_plan`)."""
    return _parallelize(
        part, mesh, "semi_auto", example_inputs, False, None, bucket_mb, None, batch_axes, module_plan,
        plan_root=root, check_once_per_shape=check_once_per_shape, ep=ep,
    )  # fmt: skip


def _parallelize(
    model: nn.Module,
    mesh: Mesh,
    mode: str,
    example_inputs: Sequence[Any] | None,
    full_batch: bool,
    parameter_plan: dict[str, Any] | None,
    bucket_mb: float,
    example_kwargs: dict[str, Any] | None,
    batch_axes: str | Sequence[str] | None,
    module_plan: dict[str, Any] | None,
    plan_root: nn.Module | None = None,
    check_once_per_shape: bool = False,
    ep: int = 1,
) -> nn.Module:
    if mode == "data_parallel":
        if parameter_plan or module_plan or ep > 1:
            what = "parameter_plan" if parameter_plan else "module_plan" if module_plan else f"ep = {ep}"
            raise ValueError(f"parallelize: {what} needs mode='semi_auto'")
        if batch_axes is not None and tuple([batch_axes] if isinstance(batch_axes, str) else batch_axes) != (
            "dp",
        ):
            raise ValueError(
                f"parallelize(mode='data_parallel'): batch_axes={batch_axes!r}, but data parallelism cuts the "
                f"batch over every rank, on the 'dp' axis; drop batch_axes or use mode='semi_auto'"
            )
        if mesh.dp_size != mesh.world_size:
            raise ValueError(
                f"parallelize(mode='data_parallel') replicates the whole model on every rank, so every device "
                f"must be on the 'dp' axis; the mesh is {mesh}: call loom.init() or loom.init(mesh={{'dp': -1}})"
            )
        _broadcast_from_rank0(model)
        sync = GradSync(model, data_parallel_route(), bucket_mb)
        sync.batch_rows = BatchRows()
        model.register_forward_pre_hook(
            lambda module, args, kwargs: sync.batch_rows.note(module, args, kwargs), with_kwargs=True
        )
        model.loom = ParallelState(mode=mode, mesh=mesh, full_batch=full_batch, grad_sync=sync)
        return model
    if example_inputs is None and module_plan is None:
        raise ValueError(
            "parallelize(mode='semi_auto') needs example_inputs (one batch, as forward takes it), e.g. "
            "example_inputs=(x,) or (x, y), or a module_plan giving the model's modules their strategies"
        )
    batch_dims = _batch_dims(mesh, batch_axes, full_batch)
    batch_factor = math.prod(mesh.canonical_shape[d] for d in batch_dims)
    bind_primitives(model, mesh)  # the model's loom.ops compute on `mesh`, whichever mesh is current
    recording, meta_names = Recording(), {}
    if example_inputs is not None:
        recording, meta_names = _dry_run(model, example_inputs, example_kwargs or {}, batch_factor)
    layouts, consumers = _parameter_layouts(recording, meta_names)
    module_plan, experts = expert_module_plan(model, module_plan or {}, mesh, ep, root=plan_root)
    resolved = resolve_module_plan(model, module_plan, root=plan_root)
    planned, patterns = module_parameter_layouts(model, resolved, mesh, ep)
    layouts.update(planned)
    consumers.update({name: f"module_plan {pattern!r}" for name, pattern in patterns.items()})
    layouts.update(_planned(model, parameter_plan or {}, mesh, ep))
    consumers.update({name: "parameter_plan" for name in parameter_plan or {}})
    if consistency.setting() != "off":
        _check_plan(
            recording, layouts, mesh, full_batch, batch_dims, example_inputs or (), example_kwargs or {}
        )
    lay_out_parameters(model, layouts, mesh)
    apply_module_plan(model, resolved, mesh, ep)
    first_forward = FirstForwardCheck(mesh, batch_dims, full_batch, once_per_shape=check_once_per_shape)
    model.register_forward_pre_hook(first_forward.before, with_kwargs=True)
    model.register_forward_hook(first_forward.after, always_call=True)
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    sync = GradSync(model, dtensor_route(mesh), bucket_mb, after_sync=fix_placements(params))
    connected = connect_experts(model, mesh, experts)
    if ep > 1 and connected != ep:
        raise ValueError(
            f"parallelize: the plan has ep = {ep}, but the model's experts came out cut over {connected} ranks; "
            f"build loom's GPT with Strategies(ep={ep}) (its layout is its own), or set ep = {connected}"
        )
    all_layouts = {name: layout_of(p) for name, p in model.named_parameters()}
    model.loom = ParallelState(
        mode=mode,
        mesh=mesh,
        full_batch=full_batch,
        grad_sync=sync,
        parameter_layouts=all_layouts,
        consumers=consumers,
        batch_dims=batch_dims,
    )
    return model


def _context_parallel(model: nn.Module, mesh: Mesh, plan: Plan) -> None:
    """A plan with cp > 1: loom's GPT cuts its own sequences (its `Strategies` must say the same); a
    Hugging Face model's attention modules, named by its family's recipe, attend over the cp group and its
    inputs are cut before they become DTensors (`loom.parallel.hf_context`)."""
    strategies = getattr(model, "strategies", None)
    if hasattr(strategies, "cp"):
        if (strategies.cp, strategies.attention) != (plan.cp, plan.attention):
            raise ValueError(
                f"parallelize: the plan has cp = {plan.cp} with {plan.attention} attention, but the model was "
                f"built with Strategies(cp={strategies.cp}, attention={strategies.attention!r}); build it with "
                f"the plan's"
            )
        return
    recipe = known_recipe(model)
    apply_context_parallel(
        model, mesh, attention=plan.attention, modules=recipe.attention if recipe else None, tp=plan.tp
    )


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DDP does."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=0)


def _dry_run(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any],
    batch_factor: int,
) -> tuple[Recording, dict[int, str]]:
    """Run a meta-device copy of `model` on global-shaped meta inputs, recording the sharded operators;
    also return the names of the copy's parameters by id."""
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    meta_model = copy.deepcopy(model, memo)
    inputs = [global_meta(x, batch_factor) for x in example_inputs]
    kwargs = {key: global_meta(x, batch_factor) for key, x in example_kwargs.items()}
    with torch.no_grad(), record() as recording:
        meta_model(*inputs, **kwargs)
    names: dict[int, str] = {}
    for name, param in meta_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)  # a tied parameter goes by its first name, as layouts are keyed
    return recording, names


def _parameter_layouts(
    recording: Recording, names: dict[int, str]
) -> tuple[dict[str, TensorLayout], dict[str, str]]:
    """Each parameter's layout: the one its first sharded consumer asked for."""
    layouts: dict[str, TensorLayout] = {}
    consumers: dict[str, str] = {}
    for event in recording.events:
        for item in event.inputs:
            name = names.get(id(item.tensor))
            if name is not None and name not in layouts:
                layouts[name] = item.after
                consumers[name] = f"{event.op} input {item.name}"
    return layouts, consumers


def _planned(
    model: nn.Module, plan: dict[str, Any], mesh: Mesh, ep: int = 1, what: str = "parameter_plan"
) -> dict[str, TensorLayout]:
    """`parameter_plan` (name -> cuts, axis names or a Layout map; "ep": the innermost `ep` ranks of "dp")
    compiled, keyed by each parameter's first name (a tied parameter is laid out once, under the name
    `lay_out_parameters` sees first); `what` names the plan in errors."""
    first: dict[int, str] = {}
    shapes: dict[str, torch.Size] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
        shapes[name] = param.shape
    by_name = {name: first[id(param)] for name, param in model.named_parameters(remove_duplicate=False)}
    layouts = {}
    for name, entry in plan.items():
        if name not in shapes:
            raise ValueError(f"{what} names unknown parameter {name!r}; the parameters are {sorted(shapes)}")
        entry = on_mesh_axes(entry, mesh.axis_sizes(), ep)
        (layout,) = compile_inputs(
            f"parameter {name}", [name], (entry,), [shapes[name]], mesh.canonical_shape
        )
        if layout is not None:
            layouts[by_name[name]] = layout
    return layouts


def _check_arguments(
    model: object, mode: str, example_inputs: object, example_kwargs: object, bucket_mb: object
) -> Sequence[Any] | None:
    """Clear errors for the arguments a user can get wrong; a lone tensor as example_inputs is taken as
    `(tensor,)`."""
    if not isinstance(model, nn.Module):
        what = getattr(model, "__name__", None) or type(model).__name__
        hint = (
            f"for a function use loom.shard({what}, in_strategy), or wrap it in an nn.Module"
            if callable(model)
            else "pass the nn.Module itself"
        )
        raise TypeError(f"loom.parallelize takes an nn.Module; got {type(model).__name__} {what!r}: {hint}")
    if mode not in MODES:
        raise ValueError(f"parallelize: unknown mode {mode!r}; choose one of {MODES}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif example_inputs is not None and not isinstance(example_inputs, tuple | list):
        raise TypeError(
            f"parallelize: example_inputs must be a tuple of forward's positional inputs, e.g. (x,) or (x, y); "
            f"got {type(example_inputs).__name__}"
            + (": keyword inputs go in example_kwargs" if isinstance(example_inputs, dict) else "")
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(
            f"parallelize: example_kwargs must be a dict of forward's keyword inputs, e.g. {{'mask': m}}; "
            f"got {type(example_kwargs).__name__}"
        )
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not bucket_mb > 0:
        raise ValueError(
            f"parallelize: bucket_mb must be a positive number of megabytes (default 25.0); got {bucket_mb!r}"
        )
    return example_inputs


def _check_auto(
    mode: str | None, example_inputs: object, example_kwargs: object, memory_limit: object, given: object
) -> None:
    """Clear errors for `mode="auto"`'s arguments (and for the planner's arguments without it)."""
    if mode != "auto":
        if memory_limit is not None:
            raise ValueError("parallelize: memory_limit is the planner's (mode='auto')")
        return
    if given:
        raise ValueError(
            "parallelize(mode='auto') chooses the plan itself: leave out plan, module_plan and parameter_plan"
        )
    if example_inputs is None and not example_kwargs:
        raise ValueError(
            "parallelize(mode='auto') needs example_inputs (and example_kwargs): the planner traces the "
            "model on them; pass this rank's batch, e.g. example_inputs=(x,)"
        )
    if memory_limit is not None and not (
        isinstance(memory_limit, int | float) and not isinstance(memory_limit, bool) and memory_limit > 0
    ):
        raise ValueError(
            f"parallelize: memory_limit is bytes per device, a positive number; got {memory_limit!r}"
        )


def _batch_dims(mesh: Mesh, batch_axes: str | Sequence[str] | None, full_batch: bool) -> tuple[int, ...]:
    """The canonical mesh dims that cut the batch: those of `batch_axes` (default "dp" and "cp"), none with
    `full_batch`."""
    if batch_axes is None:
        # context-parallel ranks bring different pieces of the sequences: rows of their own, as dp's
        axes: tuple[str, ...] = tuple(a for a in ("dp", "cp") if a in mesh.shape.names)
        if not (axes or full_batch):
            raise ValueError(
                f"parallelize(mode='semi_auto'): the mesh {mesh} has no 'dp' axis (nor 'cp'), so loom cannot tell which "
                f"ranks bring different parts of the batch: pass batch_axes naming the mesh axes that split the "
                f"batch (e.g. batch_axes=({mesh.shape.names[0]!r},)), or batch_axes=() if every rank brings the "
                f"same whole batch (or full_batch=True)"
            )
    else:
        axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        for axis in axes:
            if axis not in mesh.shape.names:
                raise ValueError(
                    f"parallelize: batch_axes names {axis!r}, which is not an axis of the mesh {mesh}; "
                    f"use some of {list(mesh.shape.names)}, or () if every rank brings the same whole batch"
                )
    if full_batch:
        return ()
    return tuple(sorted(d for axis in axes for d in mesh.shape.canonical_dims_of(axis)))


def _check_plan(
    recording: Recording,
    layouts: dict[str, TensorLayout],
    mesh: Mesh,
    full_batch: bool,
    batch_dims: tuple[int, ...],
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any],
) -> None:
    """Before any parameter moves: every rank found the same operators with the same strategies, and the same
    settings (one small all-gather; see `loom.dist.consistency`)."""
    names, shape = mesh.device_mesh.mesh_dim_names, mesh.canonical_shape
    inputs = {f"#{i}": x for i, x in enumerate(example_inputs)} | example_kwargs
    settings = f"full_batch={full_batch}, batch dims {batch_dims}, example inputs " + ", ".join(
        f"{k} {tuple(x.shape)}" for k, x in inputs.items() if isinstance(x, torch.Tensor)
    )
    claims = [
        consistency.text_claim("the parallelize settings", settings, "call parallelize alike on every rank")
    ]
    for i, event in enumerate(recording.events):
        text = f"{event.op}: " + ", ".join(
            f"{item.name} {tuple(item.tensor.shape)} -> {item.after.describe(names, shape)}"
            for item in event.inputs
        )
        claims.append(
            consistency.text_claim(
                f"the strategy of operator #{i} ({event.op})", text, consistency.STRATEGY_FIX
            )
        )
    text = ", ".join(f"{name}: {layout.describe(names, shape)}" for name, layout in sorted(layouts.items()))
    claims.append(consistency.text_claim("the parameter layouts", text, consistency.STRATEGY_FIX))
    group, device = consistency.mesh_group(mesh)
    consistency.agree(claims, group, "loom.parallelize(mode='semi_auto')", device=device)


INPUT_FIX = (
    "the ranks that read the same rows (the same index along the batch axes) must bring the same local batch: "
    "feed every rank its rows from one seeded sampler (dp index = its part), or, on a mesh whose ranks all "
    "bring different data, name those axes in batch_axes"
)
FULL_BATCH_FIX = (
    "with full_batch=True every rank must bring the same whole batch: load it the same way on every rank "
    "(seeded), or pass each rank's own part of the batch with full_batch=False"
)


class FirstForwardCheck:
    """The forward hooks of a semi_auto model: plain inputs become global DTensors, and tensors the model
    creates inside forward are lifted to replicated DTensors (`loom.parallel.lift`); on the first forward
    (every forward with LOOM_CHECK=1) the ranks also check, in one all-gather at its end, that the ranks that
    must bring the same inputs did, and that the operators ran with the same strategies everywhere."""

    def __init__(
        self, mesh: Mesh, batch_dims: tuple[int, ...], full_batch: bool, *, once_per_shape: bool = False
    ) -> None:
        self.mesh, self.batch_dims, self.full_batch = mesh, batch_dims, full_batch
        # the input shapes whose even-batch check passed (None: check every forward)
        self.checked: set[tuple] | None = set() if once_per_shape else None
        self.check = consistency.FirstCall()
        self.tokens: list[tuple[object, consistency.Scope, list | None, LiftPlainTensors]] = []

    def before(self, _: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        labelled = [(f"input #{i}", x) for i, x in enumerate(args)] + [
            (f"input {k!r}", x) for k, x in kwargs.items()
        ]
        plain = [
            (label, x) for label, x in labelled if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        ]
        due = self.check.due() and consistency.checkable([x for _, x in plain])
        claims = []
        if due:
            self.check.done = True
            fix = FULL_BATCH_FIX if self.full_batch else INPUT_FIX
            claims = [
                consistency.tensor_claim(f"{label} (a plain tensor)", x, fix, peers=bool(self.batch_dims))
                for label, x in plain
            ]
        result = _distribute_inputs(args, kwargs, self.mesh, self.batch_dims, checked=self.checked)
        if not torch.compiler.is_compiling():
            scope, token = consistency.enter_scope(collect=due)
            lift = LiftPlainTensors(scope)
            lift.__enter__()
            self.tokens.append((token, scope, claims if due else None, lift))
        return result

    def after(self, _: nn.Module, __: tuple, output: Any) -> None:
        if not self.tokens:
            return
        token, scope, claims, lift = self.tokens.pop()
        lift.__exit__(None, None, None)
        consistency.exit_scope(token)
        if claims is None or sys.exc_info()[1] is not None:
            return  # not a checked forward, or the forward raised
        key = _batch_index(self.mesh, self.batch_dims)
        group, device = consistency.mesh_group(self.mesh)
        consistency.agree(
            claims + scope.claims, group, "the first forward of a semi_auto model", key=key, device=device
        )


def _batch_index(mesh: Mesh, batch_dims: tuple[int, ...]) -> int:
    """This rank's index along the batch dims (the ranks with the same index read the same rows)."""
    index = 0
    for dim in batch_dims:
        index = index * mesh.canonical_shape[dim] + mesh.device_mesh.get_local_rank(dim)
    return index


def _distribute_inputs(
    args: tuple,
    kwargs: dict,
    mesh: Mesh,
    batch_dims: tuple[int, ...],
    *,
    checked: set[tuple] | None = None,
) -> tuple[tuple, dict]:
    """Plain tensor inputs (positional or keyword) become global DTensors: the local batches of the batch
    axes' ranks stacked on dim 0 (ranks along other axes read the same batch), or, without batch dims, the
    full batch on every rank. Their sizes are checked to be even (`check_even_batches`) every time, or, with
    `checked` (the shapes checked before), once per distinct shape."""
    tensors = [
        x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
    ]
    shapes = tuple(tuple(x.shape) for x in tensors)
    if batch_dims and tensors and (checked is None or shapes not in checked):
        check_even_batches(tensors, mesh)
        if checked is not None:
            checked.add(shapes)

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        placements = [Shard(0) if d in batch_dims and x.ndim else Replicate() for d in range(mesh.ndim)]
        return DTensor.from_local(x, mesh.device_mesh, placements, run_check=False)

    return tuple(convert(x) for x in args), {key: convert(x) for key, x in kwargs.items()}
