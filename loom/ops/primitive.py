"""`Primitive`: the base of loom's MindSpore-style operators, with `.shard(in_strategy, out_strategy)`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist import consistency
from loom.dist.context import current_mesh
from loom.dist.mesh import Mesh
from loom.layout import compile_inputs, compile_operator, layout_of, to_layout
from loom.layout.strategy import check_entry_count, check_entry_kinds
from loom.layout.tensor_layout import TensorLayout
from loom.ops.trace import InputEvent, OpEvent, active_recording


class Primitive:
    """An operator with global semantics: sharded or not, it computes what the unsharded operator computes.

    Subclasses name their tensor inputs, label the dims of those inputs (dims with one label are cut alike:
    `ik`, `kj` for a matmul), and compute on (D)Tensors. Non-tensor arguments (an axis, a shape) follow the
    tensors in the call and have no strategy entry, as in MindSpore.
    """

    input_names: tuple[str, ...] = ("x",)

    def __init__(self) -> None:
        self.in_strategy: tuple | None = None
        self.out_strategy: tuple | None = None
        # the mesh of the model this primitive belongs to, set when `loom.parallelize` lays the model out
        # (`bind_primitives`); unbound, it computes on the current mesh (`loom.init`'s, the API surface)
        self.mesh: Mesh | None = None
        # laid out by the automatic planner (`bind_primitives(..., follow_inputs=True)`): the strategies are
        # set aside and the operator computes on its inputs as they arrive, by DTensor's own rules
        self.follow_inputs = False
        self._check = consistency.FirstCall()

    @property
    def name(self) -> str:
        return type(self).__name__

    def shard(self, in_strategy: tuple, out_strategy: tuple | None = None) -> Self:
        """Set how each input is cut (and, optionally, the output's layout); returns the primitive."""
        check_entry_count(self.name, in_strategy, self.input_names)
        check_entry_kinds(self.name, in_strategy, self.input_names)
        if out_strategy is not None:
            check_entry_count(self.name, out_strategy, ("output",), "out_strategy")
            check_entry_kinds(self.name, out_strategy, ("output",))
        self.in_strategy, self.out_strategy = tuple(in_strategy), out_strategy
        return self

    def labels(self, shapes: Sequence[torch.Size], *extra: object) -> list[str]:
        """One label per dim of each input; paired dims share a label."""
        raise NotImplementedError

    def uncut(self, shapes: Sequence[torch.Size], *extra: object) -> dict[str, str]:
        """Labels that must not be cut, with the reason (for the error message)."""
        return {}

    def compute(self, *args: object) -> torch.Tensor:
        """The operator itself on (D)Tensors, tensors first, then the non-tensor arguments."""
        raise NotImplementedError

    def default_strategy(self, shapes: Sequence[torch.Size], mesh: Mesh, *extra: object) -> tuple:
        """MindSpore's default for an operator without a strategy: data parallel. The first dim of the
        input with the most dims (the batch; lower-rank inputs are weights or broadcast operands) is cut
        over as many devices as divide it, and every input sharing that dim alike."""
        labels = self.labels(shapes, *extra)
        batch = max(range(len(shapes)), key=lambda i: len(shapes[i]))
        if not shapes[batch]:
            return tuple(() for _ in shapes)
        first = labels[batch][0]
        cut = math.gcd(mesh.world_size, shapes[batch][0])
        return tuple(
            tuple(cut if label == first and size != 1 else 1 for label, size in zip(lab, shape, strict=True))
            for lab, shape in zip(labels, shapes, strict=True)
        )

    def __call__(self, *args: object) -> torch.Tensor:
        count = len(self.input_names)
        tensors, extra = args[:count], args[count:]
        if len(tensors) < count or not all(isinstance(t, torch.Tensor) for t in tensors):
            got = ", ".join(type(a).__name__ for a in args) or "nothing"
            raise TypeError(
                f"{self.name} takes {count} tensor input(s) ({', '.join(self.input_names)}) first, then its "
                f"other arguments; got {got}: pass tensors (torch.tensor(...) for numbers or lists)"
            )
        if self.follow_inputs:
            return self.compute(*tensors, *extra)
        mesh = self.mesh if self.mesh is not None else current_mesh()
        recording = active_recording()
        dry_run = recording is not None and any(t.is_meta for t in tensors)
        sharded = self.in_strategy is not None or dry_run or any(isinstance(t, DTensor) for t in tensors)
        if mesh is None or not sharded:
            return self.compute(*tensors, *extra)
        layouts = self.input_layouts(tensors, mesh, *extra)
        event = OpEvent(op=self.name, inputs=[])
        if recording is not None:
            recording.events.append(event)
            event.inputs = [
                InputEvent(
                    name=n, tensor=t, before=layout_of(t) if isinstance(t, DTensor) else None, after=lay
                )
                for n, t, lay in zip(self.input_names, tensors, layouts, strict=True)
            ]
        if dry_run:
            return self.compute(*tensors, *extra)
        if self._check.due() and consistency.checkable(tensors):
            self._check.done = True
            consistency.submit(self.claims(tensors, layouts, mesh), mesh, f"{self!r}")
        inputs = [
            to_layout(t, lay, mesh, f"{self.name} input {n}")
            for t, lay, n in zip(tensors, layouts, self.input_names, strict=True)
        ]
        out = self.compute(*inputs, *extra)
        if self.out_strategy is not None:
            out = self._to_out_layout(out, mesh)
        event.output = layout_of(out) if isinstance(out, DTensor) else None
        return out

    def input_layouts(
        self, tensors: Sequence[torch.Tensor], mesh: Mesh, *extra: object
    ) -> list[TensorLayout]:
        """The validated layout of every input under this primitive's strategy (or the default one)."""
        shapes = [t.shape for t in tensors]
        strategy = self.in_strategy or self.default_strategy(shapes, mesh, *extra)
        return compile_operator(
            self.name,
            self.input_names,
            self.labels(shapes, *extra),
            strategy,
            shapes,
            mesh.canonical_shape,
            self.uncut(shapes, *extra),
        )

    def claims(
        self, tensors: Sequence[torch.Tensor], layouts: Sequence[TensorLayout], mesh: Mesh
    ) -> list[consistency.Claim]:
        """What every rank must agree on for this call: the strategy (as compiled, with the input shapes),
        and every plain input tensor, which is taken as the same global tensor on every rank."""
        names, shape = mesh.device_mesh.mesh_dim_names, mesh.canonical_shape
        text = f"{self!r} on inputs " + ", ".join(
            f"{n} {tuple(t.shape)} -> {lay.describe(names, shape)}"
            for n, t, lay in zip(self.input_names, tensors, layouts, strict=True)
        )
        claims = [
            consistency.tensor_claim(
                f"{self.name} input {name} (a plain tensor)", t, consistency.REPLICATED_FIX
            )
            for name, t in zip(self.input_names, tensors, strict=True)
            if not isinstance(t, DTensor)
        ]
        claims.append(consistency.text_claim(f"the strategy of {self.name}", text, consistency.STRATEGY_FIX))
        return claims

    def _to_out_layout(self, out: torch.Tensor, mesh: Mesh) -> torch.Tensor:
        (layout,) = compile_inputs(
            f"{self.name} (output)", ["output"], self.out_strategy, [out.shape], mesh.canonical_shape
        )
        return to_layout(out, layout, mesh, f"{self.name} output") if layout is not None else out

    def __repr__(self) -> str:
        text = f"{self.name}()"
        if self.in_strategy is not None:
            text += f".shard({self.in_strategy}" + (f", {self.out_strategy})" if self.out_strategy else ")")
        return text


def bind_primitives(model: nn.Module, mesh: Mesh, follow_inputs: bool | None = None) -> None:
    """Make every primitive held by `model`'s modules compute on `mesh` (the mesh the model is laid out on),
    whatever mesh is current when it runs: a pipeline stage on its stage mesh, the whole model elsewhere.
    `follow_inputs=True` (the automatic planner chose the layouts) sets the primitives' strategies aside:
    they compute on their inputs as those arrive; None leaves that setting as it is."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Primitive):
                value.mesh = mesh
                if follow_inputs is not None:
                    value.follow_inputs = follow_inputs
