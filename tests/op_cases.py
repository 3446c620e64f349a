"""Random valid (primitive, shapes, strategy) cases for the property-based sweep, and their check.

Cases are drawn in the test process (hypothesis) and checked on every rank of a worker pool: the sharded
primitive's output and input gradients must equal the single-device ones, and, once the inputs are in their
layouts, the operator itself must run without any collective (the strategy is a local computation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.layout import to_layout

PRIMITIVES = [
    "MatMul", "BatchMatMul", "Add", "Sub", "Mul", "Div", "ReLU", "GELU", "Softmax", "LayerNorm", "Transpose",
    "Reshape", "ReduceSum", "ReduceMean", "Gather", "Identity",
]  # fmt: skip
ATOL = RTOL = 1e-5  # fp32; sharded reductions sum in another order than the single-device kernel


@dataclass(frozen=True)
class OpCase:
    """One primitive call: constructor kwargs, input shapes, strategy, trailing non-tensor args."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    strategy: tuple[tuple[int, ...], ...]
    kwargs: dict = field(default_factory=dict, hash=False)
    extra: tuple = ()
    seed: int = 0


@st.composite
def cuts_for(draw, labels: str, world: int, uncut: str = "") -> dict[str, int]:
    """A cut per label, powers of two whose product divides `world` (a power of two)."""
    budget = world.bit_length() - 1
    cuts = {}
    for label in draw(st.permutations(list(labels))):
        exponent = 0 if label in uncut else draw(st.integers(0, budget))
        budget -= exponent
        cuts[label] = 2**exponent
    return cuts


@st.composite
def op_case(draw, name: str, world: int) -> OpCase:
    seed = draw(st.integers(0, 2**16))
    return _DRAW[name](draw, name, world, seed)


def _sizes(draw, cuts: dict[str, int]) -> dict[str, int]:
    return {label: cut * draw(st.integers(1, 3)) for label, cut in cuts.items()}


def _case(name, labels, cuts, sizes, seed, kwargs=None, extra=(), broadcast=frozenset()) -> OpCase:
    """Shapes and strategy of inputs labelled `labels`; (input, dim) pairs in `broadcast` get size 1."""
    shapes, strategy = [], []
    for i, lab in enumerate(labels):
        shapes.append(tuple(1 if (i, d) in broadcast else sizes[c] for d, c in enumerate(lab)))
        strategy.append(tuple(1 if (i, d) in broadcast else cuts[c] for d, c in enumerate(lab)))
    return OpCase(name, tuple(shapes), tuple(strategy), kwargs or {}, extra, seed)


def _matmul(draw, name, world, seed):
    ta, tb = draw(st.booleans()), draw(st.booleans())
    batch = "" if name == "MatMul" else "AB"[: draw(st.integers(1, 2))]
    w_batch = batch[draw(st.integers(0, len(batch))) :]  # w may broadcast over leading batch dims
    cuts = draw(cuts_for(batch + "ikj", world))
    labels = [batch + ("ki" if ta else "ik"), w_batch + ("jk" if tb else "kj")]
    return _case(name, labels, cuts, _sizes(draw, cuts), seed, {"transpose_a": ta, "transpose_b": tb})


def _elementwise(draw, name, world, seed):
    rank = draw(st.integers(1, 3))
    x = "abc"[:rank]
    y = x[draw(st.integers(0, rank - 1)) :]
    cuts = draw(cuts_for(x, world))
    offset = rank - len(y)
    broadcast = {(1, d) for d in range(len(y)) if draw(st.integers(0, 3)) == 0}
    broadcast |= {
        (0, d + offset) for d in range(len(y)) if (1, d) not in broadcast and draw(st.integers(0, 5)) == 0
    }
    return _case(name, [x, y], cuts, _sizes(draw, cuts), seed, broadcast=frozenset(broadcast))


def _unary(draw, name, world, seed):
    labels = "abc"[: draw(st.integers(1, 3))]
    cuts = draw(cuts_for(labels, world))
    kwargs = {"approximate": draw(st.sampled_from(["none", "tanh"]))} if name == "GELU" else {}
    return _case(name, [labels], cuts, _sizes(draw, cuts), seed, kwargs)


def _softmax(draw, name, world, seed):
    rank = draw(st.integers(1, 3))
    labels = "abc"[:rank]
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=2, unique=True))
    axis = axes[0] - rank if len(axes) == 1 else tuple(axes)
    cuts = draw(cuts_for(labels, world, uncut="".join(labels[a] for a in axes)))
    return _case(name, [labels], cuts, _sizes(draw, cuts), seed, {"axis": axis})


def _layernorm(draw, name, world, seed):
    rank = draw(st.integers(2, 3))
    labels = "abc"[:rank]
    norm = draw(st.integers(1, rank - 1))
    params = draw(st.integers(1, norm))
    cuts = draw(cuts_for(labels, world, uncut=labels[norm:]))
    kwargs = {"begin_norm_axis": norm, "begin_params_axis": params, "epsilon": 1e-5}
    return _case(name, [labels, labels[params:], labels[params:]], cuts, _sizes(draw, cuts), seed, kwargs)


def _transpose(draw, name, world, seed):
    labels = "abc"[: draw(st.integers(2, 3))]
    cuts = draw(cuts_for(labels, world))
    perm = tuple(draw(st.permutations(range(len(labels)))))
    return _case(name, [labels], cuts, _sizes(draw, cuts), seed, extra=(perm,))


def _reshape(draw, name, world, seed):
    labels = "abc"[: draw(st.integers(2, 3))]
    cuts = draw(cuts_for(labels, world))
    case = _case(name, [labels], cuts, _sizes(draw, cuts), seed)
    shape = list(case.shapes[0])
    if draw(st.booleans()):  # merge two neighbouring dims
        d = draw(st.integers(0, len(shape) - 2))
        shape[d : d + 2] = [shape[d] * shape[d + 1]]
    else:  # flatten everything
        shape = [-1]
    return OpCase(name, case.shapes, case.strategy, {}, (tuple(shape),), seed)


def _reduce(draw, name, world, seed):
    rank = draw(st.integers(1, 3))
    labels = "abc"[:rank]
    cuts = draw(cuts_for(labels, world))
    axis = tuple(draw(st.lists(st.integers(0, rank - 1), max_size=rank, unique=True)))
    return _case(name, [labels], cuts, _sizes(draw, cuts), seed, {"keep_dims": draw(st.booleans())}, (axis,))


def _gather(draw, name, world, seed):
    ids = "ab"[: draw(st.integers(1, 2))]
    cuts = draw(cuts_for("yz" + ids, world))
    return _case(name, ["yz", ids], cuts, _sizes(draw, cuts), seed)


_DRAW = {
    "MatMul": _matmul, "BatchMatMul": _matmul, "Add": _elementwise, "Sub": _elementwise, "Mul": _elementwise,
    "Div": _elementwise, "ReLU": _unary, "GELU": _unary, "Softmax": _softmax, "LayerNorm": _layernorm,
    "Transpose": _transpose, "Reshape": _reshape, "ReduceSum": _reduce, "ReduceMean": _reduce,
    "Gather": _gather, "Identity": _unary,
}  # fmt: skip


def _inputs(case: OpCase) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(case.seed)
    tensors = [torch.randn(shape, generator=generator) for shape in case.shapes]
    if case.name == "Div":
        tensors[1] = tensors[1].abs() + 0.5  # keep the quotient well conditioned
    if case.name == "Gather":
        tensors[1] = torch.randint(0, case.shapes[0][0], case.shapes[1], generator=generator)
    return [t.requires_grad_() if t.is_floating_point() else t for t in tensors]


def check_case(case: OpCase) -> str | None:
    """Run `case` sharded on this rank's mesh; None when it matches the single-device run, else why not."""
    mesh = loom.init()
    primitive = getattr(loom.ops, case.name)(**case.kwargs)
    reference_inputs = _inputs(case)
    reference = primitive.compute(*reference_inputs, *case.extra)
    grad_out = torch.randn(reference.shape, generator=torch.Generator().manual_seed(case.seed + 1))
    reference.backward(grad_out)

    inputs = _inputs(case)
    primitive.shard(case.strategy)
    output = loom.full(primitive(*inputs, *case.extra))
    output.backward(grad_out)
    problems = []
    if not torch.allclose(output, reference, atol=ATOL, rtol=RTOL):
        problems.append(f"output differs by {(output - reference).abs().max():.3g}")
    for i, (got, want) in enumerate(zip(inputs, reference_inputs, strict=True)):
        if got.requires_grad and not torch.allclose(got.grad, want.grad, atol=ATOL, rtol=RTOL):
            problems.append(f"grad of input {i} differs by {(got.grad - want.grad).abs().max():.3g}")
    if case.name != "Reshape":  # a reshape may have to gather a cut dim first
        laid_out = [
            to_layout(t.detach(), lay, mesh)
            for t, lay in zip(inputs, primitive.input_layouts(inputs, mesh), strict=True)
        ]
        with CommDebugMode() as comm:
            primitive.compute(*laid_out, *case.extra)
        if comm.get_total_counts():
            problems.append(f"the operator issued collectives {dict(comm.get_comm_counts())}")
    return "; ".join(problems) or None
