"""`loom.parallelize`: a whole model in data-parallel or semi-automatic (strategy-driven) mode.

The order of transforms, fixed:
1. (semi_auto) a dry run on the meta device records which parameters feed which sharded operator inputs;
2. each parameter is laid out as its first consumer's strategy says (`parameter_plan` overrides), the others
   replicated, so that each rank keeps only its shards;
3. inputs become global DTensors: each rank's local batch (global batch = local batches concatenated on
   dim 0), or the whole batch on every rank with `full_batch=True`;
4. gradients that replicas computed in parts are reduced by bucketed all-reduce overlapped with backward.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from loom.dist.context import require_mesh
from loom.dist.mesh import Mesh
from loom.layout import compile_inputs
from loom.layout.parameters import lay_out_parameters, materialize
from loom.layout.tensor_layout import TensorLayout
from loom.ops.trace import Recording, record
from loom.parallel.grad_sync import GradSync
from loom.parallel.routes import data_parallel_route, dtensor_route, fix_placements

MODES = ("data_parallel", "semi_auto")


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
    mode: str = "data_parallel",
    example_inputs: Sequence[Any] | None = None,
    full_batch: bool = False,
    parameter_plan: dict[str, Any] | None = None,
    bucket_mb: float = 25.0,
    example_kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """Make `model` train on every rank of the current mesh; returns the same module, changed in place.

    `data_parallel`: each rank runs the whole model on its local batch, gradients are averaged (DDP's
    semantics). `semi_auto`: loom.ops primitives with strategies shard their operands; `example_inputs`
    and `example_kwargs` (each rank's local batch, or the whole batch with `full_batch=True`) drive the dry
    run that lays out the parameters; operators without a strategy run data parallel; outputs are global DTensors (`loom.full`).
    The decisions are in `model.loom` (`model.loom.describe()`).
    """
    if mode not in MODES:
        raise ValueError(
            f"parallelize: unknown mode {mode!r}; choose one of {MODES} ('auto' is not built yet)"
        )
    mesh = require_mesh("loom.parallelize")
    if mode == "data_parallel":
        if parameter_plan:
            raise ValueError("parallelize: parameter_plan needs mode='semi_auto'")
        if mesh.dp_size != mesh.world_size:
            raise ValueError(
                f"parallelize(mode='data_parallel') replicates the whole model on every rank, so every device "
                f"must be on the 'dp' axis; the mesh is {mesh}: call loom.init() or loom.init(mesh={{'dp': -1}})"
            )
        _broadcast_from_rank0(model)
        sync = GradSync(model, data_parallel_route(), bucket_mb)
        model.loom = ParallelState(mode=mode, mesh=mesh, full_batch=full_batch, grad_sync=sync)
        return model
    if example_inputs is None:
        raise ValueError(
            "parallelize(mode='semi_auto') needs example_inputs (one batch, as forward takes it)"
        )
    recording, meta_names = _dry_run(model, example_inputs, example_kwargs or {}, mesh, full_batch)
    layouts, consumers = _parameter_layouts(recording, meta_names)
    layouts.update(_planned(model, parameter_plan or {}, mesh))
    consumers.update({name: "parameter_plan" for name in parameter_plan or {}})
    lay_out_parameters(model, layouts, mesh)
    model.register_forward_pre_hook(
        lambda _, args, kwargs: _distribute_inputs(args, kwargs, mesh, full_batch), with_kwargs=True
    )
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    sync = GradSync(model, dtensor_route(mesh), bucket_mb, after_sync=fix_placements(params))
    all_layouts = {
        name: layouts.get(name, TensorLayout.replicated(p.ndim)) for name, p in model.named_parameters()
    }
    model.loom = ParallelState(
        mode=mode,
        mesh=mesh,
        full_batch=full_batch,
        grad_sync=sync,
        parameter_layouts=all_layouts,
        consumers=consumers,
    )
    return model


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DDP does."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=0)


def _dry_run(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any],
    mesh: Mesh,
    full_batch: bool,
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
    batch_factor = 1 if full_batch else mesh.dp_size
    inputs = [_global_meta(x, batch_factor) for x in example_inputs]
    kwargs = {key: _global_meta(x, batch_factor) for key, x in example_kwargs.items()}
    with torch.no_grad(), record() as recording:
        meta_model(*inputs, **kwargs)
    names: dict[int, str] = {}
    for name, param in meta_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)  # a tied parameter goes by its first name, as layouts are keyed
    return recording, names


def _global_meta(x: Any, batch_factor: int) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    shape = list(x.shape)
    if shape:
        shape[0] *= batch_factor
    return torch.empty(shape, dtype=x.dtype, device="meta")


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


def _planned(model: nn.Module, plan: dict[str, Any], mesh: Mesh) -> dict[str, TensorLayout]:
    shapes = dict((name, p.shape) for name, p in model.named_parameters(remove_duplicate=False))
    layouts = {}
    for name, entry in plan.items():
        if name not in shapes:
            raise ValueError(
                f"parameter_plan names unknown parameter {name!r}; the parameters are {sorted(shapes)}"
            )
        (layout,) = compile_inputs(
            f"parameter {name}", [name], (entry,), [shapes[name]], mesh.canonical_shape
        )
        if layout is not None:
            layouts[name] = layout
    return layouts


def _distribute_inputs(args: tuple, kwargs: dict, mesh: Mesh, full_batch: bool) -> tuple[tuple, dict]:
    """Plain tensor inputs (positional or keyword) become global DTensors: the local batches of the `"dp"`
    ranks stacked on dim 0 (ranks along other axes read the same batch), or the full batch on every rank."""
    batch_dims = () if full_batch else mesh.batch_dims
    tensors = [
        x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
    ]
    if batch_dims and tensors:
        _check_even_batches(tensors, mesh)

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        placements = [Shard(0) if d in batch_dims and x.ndim else Replicate() for d in range(mesh.ndim)]
        return DTensor.from_local(x, mesh.device_mesh, placements, run_check=False)

    return tuple(convert(x) for x in args), {key: convert(x) for key, x in kwargs.items()}


def _check_even_batches(tensors: list[torch.Tensor], mesh: Mesh) -> None:
    """Every data-parallel rank must bring a local batch of the same size (one tiny all-reduce)."""
    sizes = torch.tensor([float(t.shape[0]) if t.ndim else 0.0 for t in tensors])
    bounds = torch.cat([sizes, -sizes])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=mesh.sub_mesh(mesh.batch_dims).get_group())
    largest, smallest = bounds[: len(sizes)], -bounds[len(sizes) :]
    if not torch.equal(largest, smallest):
        raise ValueError(
            f"the data-parallel ranks brought local batches of different sizes ({int(smallest.min())} to "
            f"{int(largest.max())} rows): the global batch is their concatenation, cut evenly; give every "
            f"rank the same number of rows (drop or pad the last batch)"
        )
