"""Strategies for a model's own modules, addressed by path: MindSpore's `shard` for any `nn.Module`.

A module plan maps module-path patterns (`fnmatch`: `"model.layers.*.self_attn.q_proj"`, `"*.mlp.c_fc"`) to
plain data, the same keys as `loom.shard` takes:

    {"*.q_proj": {"parameter_plan": {"weight": ("tp", "None")}},
     "*.o_proj": {"parameter_plan": {"weight": ("None", "tp")}, "in_strategy": (("dp", "None", "tp"),)}}

Each entry of a strategy is either cuts per dim (`(2, 1)`, MindSpore's strategy) or mesh axis names per
dim (`("tp", "None")`: dim 0 cut along the mesh's "tp" axis; a tuple of names cuts a dim along several
axes). Axis names make a plan independent of the mesh's sizes; a name the mesh lacks means "not cut", so a
tensor-parallel plan runs unchanged on a mesh without "tp". `parameter_plan` lays out the module's own
parameters; `in_strategy` / `out_strategy`, one entry per positional input / output (None: as it comes),
redistribute what flows in and out. `"local": True` runs the module on each rank's own rows instead (see
`loom.parallel.local_region`): for modules whose operators DTensor cannot run, such as a mixture of experts'
data-dependent routing. Everything else follows from DTensor's sharding rules, so any plan
computes what the unsharded model computes; a plan only changes where the work and the communication go.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from loom.dist.mesh import Mesh
from loom.layout import compile_inputs
from loom.layout.named import on_mesh_axes
from loom.layout.tensor_layout import TensorLayout
from loom.parallel.local_region import run_locally
from loom.plan import Plan
from loom.plan.plan import plain_data
from loom.plan.specs import check_strategy
from loom.recompute import recompute
from loom.shard import lay_out_inputs, lay_out_outputs

__all__ = ["ModuleStrategy", "apply_module_plan", "module_parameter_layouts", "resolve_module_plan"]


@dataclass(frozen=True, kw_only=True)
class ModuleStrategy:
    """One module's strategy: its inputs, outputs and parameters (see the module docstring)."""

    in_strategy: tuple | None = None
    out_strategy: tuple | None = None
    parameter_plan: Mapping[str, Any] = field(default_factory=dict)
    local: bool = False

    @classmethod
    def from_data(cls, pattern: str, data: Mapping[str, Any] | ModuleStrategy) -> ModuleStrategy:
        """A strategy from plain data (JSON lists become tuples), checked by the Plan's own rule
        (`loom.plan.specs.check_strategy`), with errors naming the pattern."""
        if isinstance(data, ModuleStrategy):
            return data
        check_strategy(f"strategies[{pattern!r}]", plain_data(data))  # a module plan is a Plan's `strategies`
        plan = data.get("parameter_plan") or {}
        return cls(
            in_strategy=_tuples(data.get("in_strategy")),
            out_strategy=_tuples(data.get("out_strategy")),
            parameter_plan={name: _tuples(entry) for name, entry in plan.items()},
            local=bool(data.get("local", False)),
        )


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples strategies are written with (None stays None)."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def matching(pattern: str, names: list[str], what: str, model: nn.Module) -> list[str]:
    """The `names` (module or parameter paths of `model`) that `pattern` matches (`fnmatch`: '*' matches any
    run of characters, dots too), or an error naming `what` asked for them and what the paths look like."""
    matched = [name for name in names if fnmatchcase(name, pattern)]
    if not matched:
        leaves = sorted({name.rpartition(".")[2] for name in names})
        close = difflib.get_close_matches(pattern.rpartition(".")[2], leaves, n=1)
        hint = f"did you mean ...{close[0]!r}? " if close else ""
        examples = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(
            f"{what}: pattern {pattern!r} matches nothing in {type(model).__name__}; {hint}its paths look "
            f"like: {examples} (patterns use fnmatch: '*' matches any run of characters, dots too)"
        )
    return matched


def resolve_module_plan(
    model: nn.Module, module_plan: Mapping[str, Any], root: nn.Module | None = None
) -> dict[str, tuple[str, ModuleStrategy]]:
    """Module path -> (the pattern that matched, its strategy). A module matched by several patterns takes
    the last one (a general pattern first, exceptions after); a pattern that matches nothing is an error.
    With `root`, the model `model` is a part of (a pipeline stage), patterns match `root`'s paths and the
    result holds `model`'s modules among them, by their paths in `model`."""
    if root is not None:
        whole = resolve_module_plan(root, module_plan)
        by_module = {id(root.get_submodule(path)): entry for path, entry in whole.items()}
        return {
            path: by_module[id(module)] for path, module in model.named_modules() if id(module) in by_module
        }
    if not isinstance(module_plan, Mapping):
        raise TypeError(
            f"module_plan must be a dict of module-path patterns to strategies, e.g. "
            f"{{'*.q_proj': {{'parameter_plan': {{'weight': ('tp', 'None')}}}}}}; got {type(module_plan).__name__}"
        )
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, tuple[str, ModuleStrategy]] = {}
    for pattern, data in module_plan.items():
        strategy = ModuleStrategy.from_data(pattern, data)
        for name in matching(pattern, names, "module plan", model):
            resolved[name] = (pattern, strategy)
    return resolved


def to_entry(entry: Any, mesh: Mesh, ep: int = 1) -> Any:
    """A strategy entry on `mesh`: axis names become a `Layout` map (see `loom.layout.on_mesh_axes`; "ep"
    names the innermost `ep` ranks of "dp")."""
    return on_mesh_axes(entry, mesh.axis_sizes(), ep)


def module_parameter_layouts(
    model: nn.Module, resolved: Mapping[str, tuple[str, ModuleStrategy]], mesh: Mesh, ep: int = 1
) -> tuple[dict[str, TensorLayout], dict[str, str]]:
    """The layouts the plan gives parameters, keyed by each parameter's first name (as `named_parameters`
    lists it: a tied parameter is laid out once), and the pattern each came from ("ep": the innermost `ep`
    ranks of "dp")."""
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    layouts: dict[str, TensorLayout] = {}
    sources: dict[str, str] = {}
    for path, (pattern, strategy) in resolved.items():
        module = model.get_submodule(path)
        own = dict(module.named_parameters(recurse=False))
        for name, entry in strategy.parameter_plan.items():
            if name not in own:
                raise ValueError(
                    f"module plan {pattern!r}: {path} ({type(module).__name__}) has no parameter {name!r}; "
                    f"its parameters are {sorted(own)}"
                )
            param = own[name]
            (layout,) = compile_inputs(
                f"{path} parameter {name}",
                [name],
                (to_entry(entry, mesh, ep),),
                [param.shape],
                mesh.canonical_shape,
            )
            if layout is None:
                continue
            key = first_name[id(param)]
            if key in layouts and layouts[key] != layout:
                raise ValueError(
                    f"module plan: {path}.{name} is the same parameter as {key} (tied), laid out differently by "
                    f"{pattern!r} and {sources[key]!r}; give both the same layout"
                )
            layouts[key], sources[key] = layout, pattern
    return layouts, sources


def apply_module_plan(
    model: nn.Module, resolved: Mapping[str, tuple[str, ModuleStrategy]], mesh: Mesh, ep: int = 1
) -> None:
    """Hook the inputs and outputs of the modules whose strategies redistribute them (parameters are laid
    out by the caller, with the model's other parameters; "ep" as in `to_entry`)."""
    for path, (_, strategy) in resolved.items():
        module = model.get_submodule(path)
        if strategy.local:
            run_locally(module, path)
        if strategy.in_strategy is None and strategy.out_strategy is None:
            continue
        op = f"{path} ({type(module).__name__})"
        ins = _entries(strategy.in_strategy, mesh, ep)
        outs = _entries(strategy.out_strategy, mesh, ep)
        # Only inside a parallelized forward, whose tensors are DTensors: a copy of the model gathered
        # whole (to sample from it) runs unchanged.
        if ins is not None:
            module.register_forward_pre_hook(_input_hook(op, ins, mesh), with_kwargs=True)
        if outs is not None:
            module.register_forward_hook(
                lambda _, __, out, op=op, outs=outs: (
                    lay_out_outputs(op, out, outs, mesh) if _has_dtensor(out) else out
                )
            )


def _input_hook(op: str, ins: tuple, mesh: Mesh) -> Any:
    """A pre-hook laying out the positional inputs by `ins`, inside a parallelized forward only; a module
    called with its tensors as keywords cannot take an in_strategy (it addresses positions)."""

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not _has_dtensor((args, kwargs)):
            return None
        if not _has_dtensor(args):
            raise ValueError(
                f"module plan: {op} was called with its tensors as keywords ({sorted(kwargs)}), but its "
                f"in_strategy lays out positional inputs; give its parameters a parameter_plan instead, or "
                f"put the in_strategy on a submodule called positionally"
            )
        return lay_out_inputs(op, args, ins, mesh), kwargs

    return hook


def _has_dtensor(value: Any) -> bool:
    return any(isinstance(x, DTensor) for x in tree_flatten(value)[0])


def _entries(strategy: Sequence[Any] | None, mesh: Mesh, ep: int) -> tuple | None:
    return None if strategy is None else tuple(to_entry(entry, mesh, ep) for entry in strategy)


def plan_for_mesh(plan: Plan | str | Path, mesh: Mesh) -> Plan:
    """`plan` (or the Plan saved at that path) resolved on `mesh`, whose axis sizes it must name."""
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    plan = plan.resolve(mesh.world_size)
    wanted = plan.mesh_sizes()
    current = {name: mesh.shape.size(name) for name in mesh.shape.names}
    if {k: v for k, v in wanted.items() if v > 1} != {k: v for k, v in current.items() if v > 1}:
        raise ValueError(
            f"parallelize: the plan's mesh {wanted} is not the current mesh {current}; call "
            f"loom.init(mesh={wanted}) before parallelize (or loom.init(mesh=plan.resolve(world).mesh_sizes()))"
        )
    if plan.pp > 1:
        raise ValueError(
            f"parallelize: the plan has pp = {plan.pp}; pipeline stages are built by loom.parallel.pipeline, not by "
            f"parallelize (a Plan with pipelines runs through `loom train`)"
        )
    return plan


def pattern_layouts(
    model: nn.Module, layouts: Mapping[str, Any], mesh: Mesh, what: str = "plan.parameter_layouts"
) -> dict[str, Any]:
    """A Plan's `parameter_layouts` (or `compute_layouts`, named by `what` in errors: parameter-path pattern
    -> tensor spec) as a parameter plan by name; a pattern that matches no parameter is an error."""
    names = [name for name, _ in model.named_parameters()]
    result: dict[str, Any] = {}
    for pattern, spec in layouts.items():
        matched = matching(pattern, names, what, model)
        result.update({name: _tuples(spec) for name in matched})  # parallelize reads axis names
    return result


def recompute_modules(model: nn.Module, policies: Mapping[str, str]) -> None:
    """A Plan's `recompute_modules`: each matching module recomputes its activations with that policy."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern, policy in policies.items():
        for name in matching(pattern, names, "plan.recompute_modules", model):
            module = model.get_submodule(name)
            if getattr(module, "loom_local", False) and policy != "none":
                raise ValueError(
                    f"plan.recompute_modules: {name} runs as a local region (module plan 'local': True), whose "
                    f"forward recomputation cannot wrap; recompute the block around it instead (e.g. its parent)"
                )
            recompute(module, policy)
