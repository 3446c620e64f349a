"""Each forward operator's backward, derived from the operator alone.

For an op node that gradients flow through, `make_fx` traces `torch.autograd.grad` of that one operator on
meta tensors of the node's shapes: the result is the ATen operators autograd runs for it (what DTensor
dispatches in a parallel backward), and which of the operator's inputs and outputs autograd keeps for them
(the activations a memory model counts). Gradients are asked for the inputs that carry gradients (outputs of
trainable parameters, directly or through other operators) and from the outputs that are read.

Why per operator and not one joint forward-backward trace: see `loom.plan.capture`. Nodes with the same
operator, arguments and shapes (every block of a transformer) share one trace.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from loom.plan.graph import BackwardOp, Graph, Node, Ref, TensorInfo
from loom.plan.opcost import meta_tensor, op_bytes, op_flops, tensor_info, tensors_in

__all__ = ["derive"]


@dataclass(frozen=True)
class _Derived:
    """One operator's backward: its operators, and the input and output indices it reads (None: no
    gradient flows through the operator, as through `detach` or a comparison)."""

    ops: tuple[BackwardOp, ...] | None
    saved_inputs: tuple[int, ...] = ()
    saved_outputs: tuple[int, ...] = ()
    error: str | None = None


def derive(graph: Graph) -> Graph:
    """The graph with `requires_grad`, `backward` and `saved` filled in on every op node: gradients start
    at the trainable parameters and flow through every operator whose autograd formula passes them on."""
    cache: dict[str, _Derived] = {}
    carries = {p.node for p in graph.params.values() if p.trainable}
    nodes = []
    for node in graph.nodes:
        if node.is_op:
            node = _with_backward(graph, node, carries, cache)
            if node.requires_grad:
                carries.add(node.name)
        nodes.append(node)
    failed = sorted({derived.error for derived in cache.values() if derived.error})
    notes = tuple(f"backward not traced, counted as nothing: {text}" for text in failed)
    return dataclasses.replace(graph, nodes=tuple(nodes), notes=graph.notes + notes)


def _with_backward(graph: Graph, node: Node, carries: set[str], cache: dict[str, _Derived]) -> Node:
    infos = [graph.tensor(ref) for ref in node.inputs]
    wants = tuple(i for i, ref in enumerate(node.inputs) if ref.node in carries and infos[i].floating)
    read = {
        ref.index for user in graph.users(node.name) for ref in graph[user].inputs if ref.node == node.name
    }
    read |= {ref.index for ref in graph.outputs if ref is not None and ref.node == node.name}
    gives = tuple(i for i in sorted(read) if node.outputs[i] is not None and node.outputs[i].floating)
    if not wants or not gives:
        return dataclasses.replace(node, requires_grad=False)
    key = repr((node.target, node.skeleton(), infos, wants, gives))
    if key not in cache:
        try:
            cache[key] = _trace_backward(node, infos, wants, gives)
        except Exception as error:  # an operator without a derivative formula (a custom op): say so
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            cache[key] = _Derived(ops=(), error=f"{node.target} ({type(error).__name__}: {first})")
    derived = cache[key]
    if derived.ops is None:
        return dataclasses.replace(node, requires_grad=False)
    saved = [node.inputs[i] for i in derived.saved_inputs] + [
        Ref(node.name, i) for i in derived.saved_outputs
    ]
    return dataclasses.replace(
        node, requires_grad=True, backward=derived.ops, saved=tuple(dict.fromkeys(saved))
    )


def _trace_backward(
    node: Node, infos: list[TensorInfo], wants: tuple[int, ...], gives: tuple[int, ...]
) -> _Derived:
    """Trace autograd's backward of `node` alone; the operators after the forward call are its backward."""
    count = len(infos)
    differentiable: list[bool] = []

    def forward_and_backward(*flat: torch.Tensor) -> tuple:
        inputs, grads = list(flat[:count]), flat[count:]
        args, kwargs = node.call_args(inputs)
        out = node.op(*args, **kwargs)
        outs = out if isinstance(out, list | tuple) else (out,)
        pairs = [(outs[i], g) for i, g in zip(gives, grads, strict=True) if outs[i].requires_grad]
        differentiable.append(bool(pairs))
        if not pairs:
            return ()
        chosen, seeds = zip(*pairs, strict=True)
        return torch.autograd.grad(chosen, [inputs[i] for i in wants], seeds, allow_unused=True)

    inputs = [meta_tensor(info).requires_grad_(i in wants) for i, info in enumerate(infos)]
    grads = [meta_tensor(node.output(i), node.output(i).shape) for i in gives]
    gm = make_fx(forward_and_backward, tracing_mode="fake")(*inputs, *grads)
    return _split(gm, node, count) if differentiable[0] else _Derived(ops=None)


def _split(gm: torch.fx.GraphModule, node: Node, count: int) -> _Derived:
    """The backward operators of a traced forward-and-backward, and which forward inputs and outputs they
    read (the tensors autograd saves)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    forward = next(n for n in calls if n.target == node.op)
    outputs = {forward: 0}
    outputs |= {n: n.args[1] for n in forward.users if n.target is operator.getitem}
    ops: list[BackwardOp] = []
    saved_in: set[int] = set()
    saved_out: set[int] = set()
    for fx_node in calls[calls.index(forward) + 1 :]:
        if fx_node in outputs or str(fx_node.target).startswith("aten._assert"):
            continue
        for source in fx_node.all_input_nodes:
            if source in placeholders[:count]:
                saved_in.add(placeholders.index(source))
            elif source in outputs:
                saved_out.add(outputs[source])
        if fx_node.target is operator.getitem or fx_node.target is torch.ops.aten.detach.default:
            continue  # autograd's detaches of saved tensors alias, they compute nothing
        ops.append(_backward_op(fx_node))
    return _Derived(
        ops=tuple(ops), saved_inputs=tuple(sorted(saved_in)), saved_outputs=tuple(sorted(saved_out))
    )


def _backward_op(fx_node: torch.fx.Node) -> BackwardOp:
    to_value = lambda item: item.meta.get("val")
    args, kwargs = pytree.tree_map_only(torch.fx.Node, to_value, (tuple(fx_node.args), dict(fx_node.kwargs)))
    value = fx_node.meta.get("val")
    outs = tuple(tensor_info(v) for v in tensors_in(value))
    ins = tuple(tensor_info(t) for t in tensors_in((args, kwargs)))
    return BackwardOp(
        target=str(fx_node.target),
        inputs=ins,
        outputs=outs,
        flops=op_flops(fx_node.target, args, kwargs, value),
        bytes=op_bytes(fx_node.target, ins, outs),
    )
