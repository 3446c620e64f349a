"""The operator graph the planner works on: plain data made by `loom.plan.capture`, read by the strategy
space (`loom.plan.space`) and, later, by the solvers and the cost model. Nothing here traces or executes.

A `Graph` is a list of nodes in execution order. Sources (`input`, `parameter`, `buffer`, `constant`) hold
one tensor each; an `op` node is one ATen operator as DTensor dispatches it (`aten.mm.default`, not
`nn.Linear`), with its arguments (tensors replaced by `Ref`s to the node and output that produced them),
its output tensors, the module path that called it, its flops and bytes, and the ATen operators of its
backward. Repeated blocks (a transformer's layers) are described by `Blocks`: the graph may hold only the
first few of 96 layers, and `Graph.total` scales them up.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["SOURCE_KINDS", "BackwardOp", "Blocks", "Graph", "Node", "Param", "Ref", "TensorInfo"]

SOURCE_KINDS = ("input", "parameter", "buffer", "constant")
"""Node kinds that hold a tensor the graph reads rather than computes."""


@dataclass(frozen=True)
class Ref:
    """Output `index` of node `node` (0 for single-output nodes): how an operator names a tensor input."""

    node: str
    index: int = 0

    def __repr__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """Shape, strides and dtype of one tensor (global: the whole tensor, as one device would hold it)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # torch's name without the prefix: "float32", "int64", "bfloat16"
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    def __repr__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, kw_only=True)
class BackwardOp:
    """One ATen operator of a forward operator's backward, with its tensor inputs and outputs."""

    target: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    flops: int
    bytes: int


@dataclass(frozen=True, kw_only=True)
class Node:
    """One node of the graph.

    `kind`: one of `SOURCE_KINDS` or `"op"`. `target`: the operator (`"aten.mm.default"`) for an op, the
    parameter or buffer's path, or the input's name. `op` is the `OpOverload` itself (None for sources).
    `args` / `kwargs`: the operator's arguments with every tensor replaced by a `Ref`; `inputs`: those
    `Ref`s in argument order. `outputs`: one `TensorInfo` per output (None for an output that is not a
    tensor). `module`: the path of the innermost module whose forward called the operator ("" for the
    model itself), `module_type` its class name. `block`: the index of the repeated block the node belongs
    to (None outside the blocks). `requires_grad`: an output depends on a trainable parameter, so backward
    runs through the node. `flops`: floating-point operations (from `torch.utils.flop_counter`, 0 for an
    operator it has no formula for); `bytes`: bytes read and written (0 for views). `backward`: the ATen
    operators autograd runs for this node, and `saved`: the tensors it keeps for them (its input `Ref`s and
    `Ref`s to its own outputs).
    """

    name: str
    kind: str
    target: str
    op: Any = field(default=None, compare=False, repr=False)
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[Ref, ...] = ()
    outputs: tuple[TensorInfo | None, ...] = ()
    module: str = ""
    module_type: str = ""
    block: int | None = None
    requires_grad: bool = False
    flops: int = 0
    bytes: int = 0
    backward: tuple[BackwardOp, ...] = ()
    saved: tuple[Ref, ...] = ()

    @property
    def is_op(self) -> bool:
        return self.kind == "op"

    @property
    def is_view(self) -> bool:
        """Whether the node is an operator returning a view of its one input (a linear weight's `t`)."""
        return self.is_op and getattr(self.op, "is_view", False) and len(self.inputs) == 1

    @property
    def backward_flops(self) -> int:
        return sum(op.flops for op in self.backward)

    @property
    def backward_bytes(self) -> int:
        return sum(op.bytes for op in self.backward)

    def skeleton(self) -> Any:
        """The arguments with every tensor blanked: what, besides input shapes, decides what the operator
        does (a key for caches shared by identical operators)."""
        return pytree.tree_map_only(Ref, lambda _: "tensor", (self.args, self.kwargs))

    def call_args(self, tensors: Sequence[Any]) -> tuple[tuple, dict[str, Any]]:
        """The arguments with the `Ref`s replaced, in order, by `tensors` (to call `op` on stand-ins)."""
        supply = iter(tensors)
        return pytree.tree_map_only(Ref, lambda _: next(supply), (self.args, self.kwargs))

    def output(self, index: int = 0) -> TensorInfo:
        """Output `index`, which must be a tensor."""
        info = self.outputs[index]
        assert info is not None, f"output {index} of {self.name} is not a tensor"
        return info


@dataclass(frozen=True, kw_only=True)
class Param:
    """A parameter or buffer the graph reads: its path, the module owning it, and the operators using it.

    `aliases`: other paths of the same tensor (a tied embedding and head). `users`: the op nodes that read
    it directly; `consumers`: the first non-view op nodes reached through views and transposes (the
    operators whose strategies decide its layout: `mm` for a linear weight reached through `t`).
    `one_input`: the owning module's `forward` takes exactly one positional argument (a layer or a norm),
    so an `in_strategy` of one entry can address its call.
    """

    name: str
    kind: str  # "parameter" or "buffer"
    node: str
    info: TensorInfo
    module: str
    module_type: str
    trainable: bool
    aliases: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    one_input: bool = False


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """The model's repeated blocks: `count` blocks at `path` (an `nn.ModuleList`), of which the graph holds
    `traced` (all of them for a small model; the first two for a deep one, the others being the same
    operators on the same shapes). Every traced block has the op sequence of block 0 (`signature`, a short
    hash of operators, relative module paths and shapes). The op nodes outside the blocks: `before` them
    (embeddings, masks, positions), `between` two of them (only in a trace of every block: work between
    blocks may differ from gap to gap), and `after` them (final norm, head, loss).
    """

    path: str
    count: int
    traced: int
    signature: str
    nodes: tuple[tuple[str, ...], ...]  # op node names of each traced block
    before: tuple[str, ...]
    between: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def representative(self) -> tuple[str, ...]:
        """The op nodes of block 0, which stands for every block."""
        return self.nodes[0]


@dataclass(frozen=True, kw_only=True)
class Graph:
    """A captured model: nodes in execution order, the parameters and buffers they read, the outputs, the
    repeated blocks (None when the model has none, or they differ), `notes` on what capture could not
    do (an operator whose backward could not be traced), and `arguments`: for each input node passed to
    `forward` as a whole tensor argument (what `loom.parallelize` makes a DTensor of), how `forward` gets
    it: its parameter's name, a keyword's name (into `**kwargs` too), or `args[i]` for the i-th of
    `*args` (by the name `forward` gives it). Tensors nested in a tuple, list or dict argument are not listed."""

    model: str
    nodes: tuple[Node, ...]
    params: dict[str, Param]
    outputs: tuple[Ref | None, ...]
    blocks: Blocks | None = None
    notes: tuple[str, ...] = ()
    arguments: dict[str, str] = field(default_factory=dict, compare=False)
    _index: dict[str, Node] = field(init=False, repr=False, compare=False)
    _users: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {node.name: node for node in self.nodes}
        assert len(index) == len(self.nodes), "node names must be unique"
        users: dict[str, list[str]] = {name: [] for name in index}
        for node in self.nodes:
            for ref in dict.fromkeys(node.inputs):
                assert ref.node in index, f"{node.name} reads unknown node {ref.node}"
                users[ref.node].append(node.name)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_users", {name: tuple(names) for name, names in users.items()})

    def __getitem__(self, name: str) -> Node:
        return self._index[name]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.nodes)

    def tensor(self, ref: Ref) -> TensorInfo:
        """The tensor a `Ref` names."""
        return self[ref.node].output(ref.index)

    def users(self, name: str) -> tuple[str, ...]:
        """The nodes that read an output of node `name`, in execution order."""
        return self._users[name]

    def ops(self) -> Iterator[Node]:
        """The op nodes, in execution order."""
        return (node for node in self.nodes if node.is_op)

    def op_counts(self) -> Counter[str]:
        """How many op nodes of each operator (`"aten.mm.default"`) the graph holds."""
        return Counter(node.target for node in self.ops())

    def in_module(self, path: str) -> list[Node]:
        """The op nodes called by module `path` or its submodules."""
        prefix = path + "."
        return [n for n in self.ops() if n.module == path or n.module.startswith(prefix) or not path]

    def total(self, key: str = "flops", *, backward: bool = False) -> int:
        """`key` ("flops" or "bytes") summed over the whole model's forward (or backward) operators: the
        nodes outside the blocks once, block 0 once per block of the model (`blocks.count`), so a 96-layer
        model traced with two blocks counts 96."""
        attr = f"backward_{key}" if backward else key
        if self.blocks is None:
            return sum(getattr(n, attr) for n in self.ops())
        outside = sum(getattr(n, attr) for n in self.ops() if n.block is None)
        block = sum(getattr(self[name], attr) for name in self.blocks.representative)
        return outside + self.blocks.count * block
