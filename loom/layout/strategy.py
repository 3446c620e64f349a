"""MindSpore-style strategies (`((4, 1), (1, 1))`): validation and compilation to `TensorLayout`s.

A strategy gives, per input of an operator, how many parts each tensor dim is cut into. An operator labels
the dims of its inputs (a matmul `x[i, k] @ w[k, j]` labels them `ik` and `kj`); dims with the same label
must be cut alike. The operator's device matrix is, as in MindSpore, the cuts of its labels in order of first
appearance, preceded by the remaining factor (device count / product of the cuts) for repeated computation
on the outermost axis. That matrix is then placed on the canonical mesh (see `align_device_matrix`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from loom.layout.named import TensorMap
from loom.layout.tensor_layout import ArrangementError, TensorLayout, align_device_matrix

Strategy = tuple[tuple[int, ...], ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_entry_count(
    op: str, strategy: object, input_names: Sequence[str], what: str = "in_strategy"
) -> None:
    """One entry per input (per output for `what="out_strategy"`), or a clear error."""
    if not isinstance(strategy, tuple | list):
        raise ValueError(
            f"{op}: {what} must be a tuple with one entry per input ({', '.join(input_names)}), "
            f"e.g. {_example(len(input_names))}; got {strategy!r}"
        )
    if strategy and all(isinstance(c, int) and not isinstance(c, bool) for c in strategy):
        flat = tuple(strategy)
        entries = [repr(flat)] + [repr((1,) * len(flat))] * (len(input_names) - 1)
        fixed = "(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"
        raise ValueError(
            f"{op}: {what} {flat!r} is one flat tuple, but a strategy is one tuple per tensor "
            f"({', '.join(input_names)}), each with a cut per dim: write e.g. {fixed}"
        )
    if len(strategy) != len(input_names):
        raise ValueError(
            f"{op}: {what} has {len(strategy)} entries but the operator takes {len(input_names)} "
            f"input(s) ({', '.join(input_names)}); give one entry per input, e.g. {_example(len(input_names))}"
        )


def check_entry_kinds(op: str, strategy: tuple, input_names: Sequence[str]) -> None:
    """Each entry cuts per dim (ints) or is a `Layout` map: checked when the strategy is set, before any shape
    is known."""
    for name, entry in zip(input_names, strategy, strict=True):
        if not isinstance(entry, TensorMap):
            check_cuts(op, name, entry, list(entry) if isinstance(entry, tuple | list) else [])


def _example(count: int) -> str:
    return "(" + ", ".join(["(2, 1)"] * count) + ("," if count == 1 else "") + ")"


def check_cuts(op: str, name: str, cuts: object, shape: Sequence[int]) -> tuple[int, ...]:
    """Validate one input's cuts against its shape: right length, positive ints dividing each dim."""
    if not isinstance(cuts, tuple | list) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in cuts
    ):
        hint = ""
        if cuts is None:
            hint = " (None leaves an input as it comes only in loom.shard; an operator's input takes cuts)"
        elif isinstance(cuts, tuple | list) and any(c is None or isinstance(c, str) for c in cuts):
            hint = " (1 leaves a dim whole; axis names such as 'dp' or 'None' belong in a Layout map)"
        raise ValueError(
            f"{op}: the strategy of input {name} must be a tuple of ints, one cut per dim (1 = not cut), "
            f"e.g. (2, 1); got {cuts!r}{hint}"
        )
    if len(cuts) != len(shape):
        raise ValueError(
            f"{op}: the strategy {tuple(cuts)} of input {name} has {len(cuts)} entries but {name} has "
            f"{len(shape)} dims (shape {tuple(shape)}); give one cut per dim"
        )
    for dim, (cut, size) in enumerate(zip(cuts, shape, strict=True)):
        if cut < 1:
            raise ValueError(f"{op}: input {name} dim {dim} has cut {cut}; cuts are positive (1 = not cut)")
        if size % cut:
            raise ValueError(
                f"{op}: input {name} dim {dim} has size {size}, which the cut {cut} does not divide; "
                f"use a cut that divides {size} (one of {_divisors(size)}); uneven cuts are not supported"
            )
    return tuple(cuts)


def compile_strategy(
    op: str,
    input_names: Sequence[str],
    labels: Sequence[str],
    strategy: object,
    shapes: Sequence[Sequence[int]],
    canonical_shape: Sequence[int],
    uncut: Mapping[str, str] | None = None,
) -> list[TensorLayout]:
    """Validate an operator's strategy and compile it to one `TensorLayout` per input.

    `labels[i]` has one character per dim of input i; `uncut` maps labels that must not be cut to the reason
    (e.g. the softmax axis).
    """
    check_entry_count(op, strategy, input_names)
    all_cuts = [check_cuts(op, n, c, s) for n, c, s in zip(input_names, strategy, shapes, strict=True)]
    label_cuts = _label_cuts(op, input_names, labels, all_cuts, shapes)
    for label, reason in (uncut or {}).items():
        if label_cuts.get(label, 1) != 1:
            where = _where(label, input_names, labels)
            raise ValueError(f"{op}: {where} is cut into {label_cuts[label]}, but {reason}; use 1 there")
    world = math.prod(canonical_shape)
    used = math.prod(label_cuts.values())
    if world % used:
        raise ValueError(
            f"{op}: strategy {_fmt(strategy)} cuts into {used} parts in all, which does not divide the "
            f"device count {world}; make the product of the cuts of distinct dims divide {world}"
        )
    cut_labels = [label for label, cut in label_cuts.items() if cut > 1]
    device_matrix = [world // used] + [label_cuts[label] for label in cut_labels]
    try:
        groups = align_device_matrix(device_matrix, canonical_shape)
    except ArrangementError as error:
        raise ValueError(f"{op}: strategy {_fmt(strategy)}: {error}") from None
    axes_of = dict(zip(cut_labels, groups[1:], strict=True))
    return [
        TensorLayout(
            tuple(axes_of.get(label, ()) if cut > 1 else () for label, cut in zip(lab, cuts, strict=True))
        )
        for lab, cuts in zip(labels, all_cuts, strict=True)
    ]


def compile_input_strategy(
    op: str, name: str, cuts: object, shape: Sequence[int], canonical_shape: Sequence[int]
) -> TensorLayout:
    """Compile one input's cuts on their own (device matrix: repeated factor, then the cuts)."""
    labels = "".join(chr(ord("a") + d) for d in range(len(shape)))
    return compile_strategy(op, [name], [labels], (cuts,), [shape], canonical_shape)[0]


def _label_cuts(
    op: str,
    input_names: Sequence[str],
    labels: Sequence[str],
    all_cuts: Sequence[tuple[int, ...]],
    shapes: Sequence[Sequence[int]],
) -> dict[str, int]:
    """The cut of every label, checking that inputs sharing a label cut it alike.

    A dim of size 1 that is broadcast against a larger one is not cut (its cut must be 1).
    """
    seen: dict[str, tuple[int, str, int]] = {}
    for name, lab, cuts, shape in zip(input_names, labels, all_cuts, shapes, strict=True):
        for dim, (label, cut, size) in enumerate(zip(lab, cuts, shape, strict=True)):
            if size == 1:
                continue  # broadcast (or trivially whole): checked to be 1 by check_cuts
            if label in seen and seen[label][0] != cut:
                other_cut, other_name, other_dim = seen[label]
                raise ValueError(
                    f"{op}: input {name} dim {dim} is cut into {cut} but input {other_name} dim {other_dim}, "
                    f"which the operator pairs with it, is cut into {other_cut}; cut both alike"
                )
            seen.setdefault(label, (cut, name, dim))
    ordered: dict[str, int] = {}
    for lab in labels:
        for label in lab:
            if label not in ordered:
                ordered[label] = seen[label][0] if label in seen else 1
    return ordered


def _where(label: str, input_names: Sequence[str], labels: Sequence[str]) -> str:
    for name, lab in zip(input_names, labels, strict=True):
        if label in lab:
            return f"input {name} dim {lab.index(label)}"
    raise AssertionError(label)


def _fmt(strategy: object) -> str:
    return repr(tuple(tuple(s) if isinstance(s, list) else s for s in strategy))  # type: ignore[union-attr]
