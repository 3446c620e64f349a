"""Checks on the per-module data a Plan carries as plain JSON: operator strategies, parameter layouts,
recompute policies by module pattern, and explicit pipeline stages.

Everything is checked for shape only (numbers, axis names, keys); what the patterns match, and whether a
strategy fits an operator, is decided where a Plan is applied to a model.

A *tensor spec* describes one tensor's cut, in either of MindSpore's two forms:
- a strategy: how many parts each tensor dim is cut into, e.g. `[4, 1]`;
- a tensor map over the Plan's mesh axes: per dim `"None"`, one axis, or a list of axes (outermost
  first), e.g. `["dp", "None"]` or `[["dp", "tp"], "None"]`; each axis cuts a tensor at most once.
"""

from __future__ import annotations

import difflib
from typing import Any

from loom.cost.plan import RECOMPUTE, FieldError, check_choice

__all__ = [
    "MESH_AXES",
    "STRATEGY_KEYS",
    "check_layouts",
    "check_recompute_modules",
    "check_stages",
    "check_strategies",
    "check_strategy",
    "check_tensor_spec",
]

MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "ep", "tp")  # outermost first; tp on the fastest links
STRATEGY_KEYS: tuple[str, ...] = ("in_strategy", "out_strategy", "parameter_plan", "local")
OWNER = "plan"


def _pattern(key: str, pattern: Any) -> None:
    """A module or parameter path pattern: a non-empty string without spaces (`*` matches one name)."""
    if not isinstance(pattern, str) or not pattern or any(c.isspace() for c in pattern):
        raise FieldError(
            OWNER, key, pattern, "use a dotted path pattern such as 'model.layers.*.mlp.up_proj'"
        )


def _mapping(key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise FieldError(OWNER, key, value, "use a table of path pattern -> value")
    for pattern in value:
        _pattern(key, pattern)
    return value


def check_tensor_spec(key: str, spec: Any) -> None:
    """`spec` is a strategy (cuts per dim) or a tensor map over `MESH_AXES` (see the module notes)."""
    if not isinstance(spec, list) or not spec:
        raise FieldError(OWNER, key, spec, "use a list with one entry per tensor dim, e.g. [2, 1]")
    if all(isinstance(cut, int) and not isinstance(cut, bool) for cut in spec):
        if min(spec) < 1:
            raise FieldError(OWNER, key, spec, "a strategy cuts each dim into 1 or more parts")
        return
    used: list[str] = []
    for entry in spec:
        axes = entry if isinstance(entry, list) else [entry]
        if entry == "None":
            continue
        for axis in axes:
            if axis not in MESH_AXES:
                raise FieldError(
                    OWNER, key, spec, f"each dim is 'None', an axis of {MESH_AXES} or a list of axes"
                )
        used += axes
    repeated = sorted({axis for axis in used if used.count(axis) > 1})
    if repeated:
        raise FieldError(OWNER, key, spec, f"axis {repeated[0]!r} cuts the tensor twice; use it once")


def _specs(key: str, value: Any, allow_none: bool) -> None:
    """A list of tensor specs, one per input (or output); `None` for an input that is not a tensor."""
    if not isinstance(value, list) or not value:
        raise FieldError(OWNER, key, value, "use a list with one tensor spec per tensor, e.g. [[2, 1]]")
    for i, spec in enumerate(value):
        if not (allow_none and spec is None):
            check_tensor_spec(f"{key}[{i}]", spec)


def check_strategies(strategies: Any) -> None:
    """Module pattern -> {"in_strategy": [...], "out_strategy": [...], "parameter_plan": {parameter name:
    tensor spec}} (each optional, as `loom.shard` takes them), or {"local": true}: the module runs on each
    rank's own rows with its parameters whole, gathered first where a Plan's `parameter_layouts` keep them
    cut (see `loom.parallel.local_region`)."""
    for pattern, entry in _mapping("strategies", strategies).items():
        check_strategy(f"strategies[{pattern!r}]", entry)


def check_strategy(key: str, entry: Any) -> None:
    """One module's strategy (see `check_strategies`), named `key` in errors."""
    if not isinstance(entry, dict):
        raise FieldError(OWNER, key, entry, f"use a table with some of the keys {STRATEGY_KEYS}")
    for name in entry:
        if name not in STRATEGY_KEYS:
            close = difflib.get_close_matches(str(name), STRATEGY_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise FieldError(OWNER, f"{key}.{name}", entry[name], f"{hint}use keys {STRATEGY_KEYS}")
    if entry.get("local", False) is not False:
        if entry["local"] is not True:
            raise FieldError(OWNER, f"{key}.local", entry["local"], "use true or false")
        if len(entry) > 1:
            raise FieldError(
                OWNER, key, entry, "a local module runs on its own rows with its parameters whole: give "
                "local alone, without in_strategy, out_strategy or parameter_plan (a Plan's parameter_layouts may "
                "keep its parameters cut: it gathers them)",
            )  # fmt: skip
        return
    if entry.get("in_strategy") is not None:
        _specs(f"{key}.in_strategy", entry["in_strategy"], allow_none=True)
    if entry.get("out_strategy") is not None:
        _specs(f"{key}.out_strategy", entry["out_strategy"], allow_none=True)
    for name, spec in _mapping(f"{key}.parameter_plan", entry.get("parameter_plan", {})).items():
        check_tensor_spec(f"{key}.parameter_plan[{name!r}]", spec)


def check_layouts(layouts: Any, key: str = "parameter_layouts") -> None:
    """Parameter pattern -> tensor spec (the plan field `key`)."""
    for pattern, spec in _mapping(key, layouts).items():
        check_tensor_spec(f"{key}[{pattern!r}]", spec)


def check_recompute_modules(policies: Any) -> None:
    """Module pattern -> recompute policy (one of `RECOMPUTE`)."""
    for pattern, policy in _mapping("recompute_modules", policies).items():
        check_choice(OWNER, f"recompute_modules[{pattern!r}]", policy, RECOMPUTE)


def check_stages(stages: Any, count: int) -> None:
    """`count` pipeline stages (pp * virtual stages), given as blocks per stage (`[3, 2, 2, 3]`, uneven
    allowed) or as the module paths of each stage (`[["model.layers.0", ...], ...]`)."""
    fix = (
        f"give {count} stages (pp * virtual_stages): blocks per stage like [3, 2], "
        "or module paths per stage like [['layers.0'], ['layers.1']]"
    )
    if not isinstance(stages, list) or len(stages) != count:
        raise FieldError(OWNER, "stages", stages, fix)
    if all(isinstance(n, int) and not isinstance(n, bool) for n in stages):
        if min(stages) < 1:
            raise FieldError(OWNER, "stages", stages, "every stage holds at least 1 block")
        return
    for i, paths in enumerate(stages):
        if not isinstance(paths, list) or not paths:
            raise FieldError(OWNER, f"stages[{i}]", paths, fix)
        for path in paths:
            _pattern(f"stages[{i}]", path)
