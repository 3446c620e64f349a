"""A model given as `package.module:function`, the way `loom plan --model` takes any `nn.Module`.

The contract: `function()` takes no arguments and returns `(model, example_args)` or `(model, example_args,
example_kwargs)`: the module, the positional inputs of one training step's forward (a tuple, or one
tensor) and its keyword inputs (a dict). The inputs are the whole step's batch (every data-parallel rank
then reads its rows, as `loom.parallelize` hands a batch over): dim 0 of every tensor input is the batch.
The forward should return the loss (or what the loss is taken of): the planner prices the backward of every
operator gradients flow through.

The function is called on the meta device (`torch.device("meta")` around the call): parameters and
inputs made in it take no memory, so a model far larger than this machine plans here. Inputs made
elsewhere are only read for their shapes and dtypes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["CONTRACT", "BuiltModel", "build_model", "is_model_spec", "load_function", "with_batch"]

CONTRACT = (
    "return (model, example_args) or (model, example_args, example_kwargs): an nn.Module, its forward's "
    "positional inputs (a tuple or one tensor) and keyword inputs (a dict), dim 0 of each tensor the batch"
)


@dataclass(frozen=True)
class BuiltModel:
    """A model built from a spec (on the meta device) with the example inputs of one step's whole batch."""

    spec: str
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]


def is_model_spec(text: str | None) -> bool:
    """Whether `text` names a Python function (`module:function`) rather than a preset or a file."""
    return bool(text) and ":" in text and not text.endswith((".toml", ".json"))


def load_function(spec: str) -> Callable[[], Any]:
    """The callable `spec` names (`package.module:function`, or `module:Class.method`), the module imported
    by name from `sys.path` and the current directory, as `python -m` finds modules. A ValueError names
    the spec and the fix."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(
            f"--model {spec!r}: a Python model is given as MODULE:FUNCTION (e.g. mypkg.models:build), the module "
            f"importable from the current directory or sys.path"
        )
    with _current_directory_importable():
        module = _import(spec, module_name)
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            public = sorted(
                name for name in vars(module) if callable(getattr(module, name)) and not name.startswith("_")
            )
            raise ValueError(
                f"--model {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no attribute "
                f"{attribute!r}; its public callables are {public[:12]}"
            )
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(
            f"--model {spec!r}: {attribute!r} is a {type(found).__name__}, not a function; name a function "
            f"that builds the model and {CONTRACT}"
        )
    return found


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ValueError(
                f"--model {spec!r}: no module {missing!r} on sys.path or in the current directory "
                f"({os.getcwd()}); run from the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        raise ValueError(f"--model {spec!r}: importing {module_name!r} failed: {error}") from error
    except Exception as error:  # noqa: BLE001 - any failure of the user's module, named with the spec
        raise ValueError(
            f"--model {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[None]:
    """The current directory first on `sys.path` while importing, as `python -m` puts it."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


def build_model(spec: str, global_batch: int | None = None) -> BuiltModel:
    """Call the function `spec` names on the meta device and check what it returns (see the module notes);
    with `global_batch`, dim 0 of every tensor input becomes that many rows (`with_batch`)."""
    # the current directory stays importable while the function runs: it may import its neighbours then
    # (imported off the meta device: a library's import-time tensors must stay real)
    with _current_directory_importable():
        function = load_function(spec)
        try:
            with torch.device("meta"):
                returned = function()
        except Exception as error:  # noqa: BLE001 - the user's builder: name it and what it raised
            raise ValueError(
                f"--model {spec!r}: calling it on the meta device raised {type(error).__name__}: {error}; it is "
                f"called with no arguments and must {CONTRACT}"
            ) from error
    model, args, kwargs = _unpack(spec, returned)
    if global_batch is not None:
        args, kwargs = with_batch(args, kwargs, global_batch)
    return BuiltModel(spec=spec, model=model, args=args, kwargs=kwargs)


def _unpack(spec: str, returned: Any) -> tuple[nn.Module, tuple, dict]:
    wrong = f"--model {spec!r} returned {_kind(returned)}; it must {CONTRACT}"
    if isinstance(returned, nn.Module):
        raise ValueError(f"{wrong} (the planner needs example inputs for the shapes)")
    if (
        not isinstance(returned, tuple)
        or len(returned) not in (2, 3)
        or not isinstance(returned[0], nn.Module)
    ):
        raise ValueError(wrong)
    args = returned[1]
    args = (args,) if isinstance(args, torch.Tensor) else args
    kwargs = returned[2] if len(returned) == 3 else {}
    if not isinstance(args, Sequence) or isinstance(args, str) or not isinstance(kwargs, Mapping):
        raise ValueError(wrong)
    return returned[0], tuple(args), dict(kwargs)


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def with_batch(args: tuple, kwargs: dict[str, Any], rows: int) -> tuple[tuple, dict[str, Any]]:
    """The inputs with dim 0 of every tensor of one dim or more resized to `rows`, wherever it sits in the
    arguments (tuples, lists, dicts), as meta tensors that keep their dtype and `requires_grad` (only
    shapes and dtypes reach the planner). A ValueError when no tensor input has a dim 0 to resize."""
    resized_any = False

    def resized(x: Any) -> Any:
        nonlocal resized_any
        if not isinstance(x, torch.Tensor) or not x.ndim:
            return x
        resized_any = True
        shape = (rows, *x.shape[1:])
        return torch.empty(shape, dtype=x.dtype, device="meta", requires_grad=x.requires_grad)

    args, kwargs = torch.utils._pytree.tree_map(resized, (tuple(args), dict(kwargs)))
    if not resized_any:
        raise ValueError(
            f"--global-batch {rows}: no tensor input has a dim 0 (the batch) to resize; leave --global-batch "
            "out and give the batch in the example inputs"
        )
    return args, kwargs
