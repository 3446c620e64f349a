"""Compile the strategy entries users write (cuts or `Layout` maps) into `TensorLayout`s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loom.layout.named import TensorMap
from loom.layout.strategy import check_entry_count, compile_input_strategy, compile_strategy
from loom.layout.tensor_layout import TensorLayout

Entry = tuple[int, ...] | TensorMap | None


def compile_operator(
    op: str,
    input_names: Sequence[str],
    labels: Sequence[str],
    strategy: object,
    shapes: Sequence[Sequence[int]],
    canonical_shape: Sequence[int],
    uncut: Mapping[str, str] | None = None,
) -> list[TensorLayout]:
    """Layouts of an operator's inputs from its strategy: all cuts (MindSpore strategy) or all `Layout`s."""
    check_entry_count(op, strategy, input_names)
    maps = [isinstance(entry, TensorMap) for entry in strategy]  # type: ignore[union-attr]
    if not any(maps):
        return compile_strategy(op, input_names, labels, strategy, shapes, canonical_shape, uncut)
    if not all(maps):
        raise ValueError(f"{op}: in_strategy mixes Layout maps and cut tuples; use one kind for all inputs")
    layouts = [
        entry.compile(op, name, shape, canonical_shape)
        for entry, name, shape in zip(strategy, input_names, shapes, strict=True)  # type: ignore[arg-type]
    ]
    _check_paired_dims(op, input_names, labels, layouts, shapes, uncut or {})
    return layouts


def _check_paired_dims(
    op: str,
    input_names: Sequence[str],
    labels: Sequence[str],
    layouts: Sequence[TensorLayout],
    shapes: Sequence[Sequence[int]],
    uncut: Mapping[str, str],
) -> None:
    seen: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for name, lab, layout, shape in zip(input_names, labels, layouts, shapes, strict=True):
        for dim, (label, axes, size) in enumerate(zip(lab, layout.dim_axes, shape, strict=True)):
            if axes and label in uncut:
                raise ValueError(f"{op}: input {name} dim {dim} is cut, but {uncut[label]}; map it to 'None'")
            if size == 1:
                continue
            if label in seen and seen[label][0] != axes:
                _, other, other_dim = seen[label]
                raise ValueError(
                    f"{op}: input {name} dim {dim} and input {other} dim {other_dim} are paired by the operator "
                    f"but mapped to different device axes; map both to the same axes"
                )
            seen.setdefault(label, (axes, name, dim))


def compile_inputs(
    op: str,
    input_names: Sequence[str],
    strategy: object,
    shapes: Sequence[Sequence[int] | None],
    canonical_shape: Sequence[int],
) -> list[TensorLayout | None]:
    """Layouts of a function's inputs, each on its own (None: leave the input as it comes)."""
    check_entry_count(op, strategy, input_names)
    layouts: list[TensorLayout | None] = []
    for entry, name, shape in zip(strategy, input_names, shapes, strict=True):  # type: ignore[arg-type]
        if entry is None:
            layouts.append(None)
        elif shape is None:
            raise ValueError(f"{op}: input {name} is not a tensor, so its strategy entry must be None")
        elif isinstance(entry, TensorMap):
            layouts.append(entry.compile(op, name, shape, canonical_shape))
        else:
            layouts.append(compile_input_strategy(op, name, entry, shape, canonical_shape))
    return layouts
