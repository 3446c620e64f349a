"""Graph capture: any `nn.Module` and example inputs -> the operator graph the planner works on.

    graph = capture(model, (ids,), {"labels": ids})
    graph.op_counts()["aten.mm.default"], graph.blocks.count, graph.total("flops", backward=True)

How, and why this way:

1. `torch.export.export(strict=False)` traces the model under fake tensors: parameters are never copied
   (a model built on the meta device stays there; its example inputs are moved to meta too), Python
   control flow runs as written (Hugging Face models build masks and positions in `forward`: fine), and
   every node carries `nn_module_stack`, the path of the modules that called it. Public and stable.
2. The exported program is traced again by `make_fx`, functionalised, with `torch.fx.traceback
   .preserve_node_meta` so that each node keeps its module path. Export keeps composite operators whole
   (`aten.linear`, `aten.layer_norm`); this second trace runs them through the dispatcher, which splits them
   into the operators DTensor dispatches and has sharding rules for (`aten.t` + `aten.addmm`,
   `aten.native_layer_norm`): the strategy space must be built on exactly those.
3. The backward is derived per operator (`loom.plan.backward`): each op node that gradients flow through
   is traced once more, alone, with `torch.autograd.grad` under `make_fx`. A joint forward-backward trace
   of the whole model (make_fx over `autograd.grad`) works too, but its backward nodes carry no module path
   and no link to the forward operator that caused them (aot_autograd recovers the link with private
   sequence-number hooks, whose API moved between torch 2.11 and 2.13); per operator, the link is by
   construction and only public API is used. Identical operators on identical shapes are traced once.
4. Repeated blocks (`loom.plan.blocks`): the block list comes from the model's recipe
   (`loom.models.recipes`), the usual paths, or structurally identical children of a `ModuleList`. When
   the blocks are identical modules, only the first two are traced (the list is shortened while tracing and
   restored after), so a 96-layer model captures as fast as a 2-layer one; `Graph.total` counts all 96.

A model that cannot be traced raises `CaptureError`, naming the module and the error, with the fallbacks.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import preserve_node_meta
from torch.utils import _pytree as pytree

from loom.plan import backward as backward_mod
from loom.plan import blocks as blocks_mod
from loom.plan.graph import Graph, Node, Param, Ref
from loom.plan.opcost import op_bytes, op_flops, tensor_info, tensors_in

__all__ = ["CaptureError", "capture"]

FALLBACKS = (
    "loom can still parallelise it without the automatic planner: mode='semi_auto' with a module plan "
    "(loom.parallelize(model, module_plan={...}), see docs/any_model.md), or mode='data_parallel'"
)

# Operators that check or describe tensors but compute nothing: dropped from the graph.
_SKIPPED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range"}


class CaptureError(ValueError):
    """The model could not be traced into an operator graph (the message says where and what to do)."""


def capture(
    model: nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    blocks: str | None = None,
    trace_blocks: int = 2,
) -> Graph:
    """Trace `model(*args, **kwargs)` into a `Graph` of ATen operators, without allocating parameters.

    `args` and `kwargs` are example inputs (real tensors, or meta ones: only their shapes and dtypes matter).
    `blocks`: the path of the model's block list when neither its recipe nor the usual paths find it.
    `trace_blocks`: how many blocks of a list of identical blocks are traced (the others run the same
    operators on the same shapes). Raises `CaptureError` for a model that cannot be traced.
    """
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    kwargs = dict(kwargs or {})
    found = blocks_mod.find_block_list(model, blocks)
    traced = found.traced_count(trace_blocks) if found is not None else 0
    graph = _capture_forward(model, args, kwargs, found, traced)
    if found is not None:
        graph = blocks_mod.assign_blocks(graph, found, traced)
        if traced < found.count and not blocks_mod.repeats(graph):  # the first blocks do not stand for all
            graph = _capture_forward(model, args, kwargs, found, found.count)
            graph = blocks_mod.assign_blocks(graph, found, found.count)
    return backward_mod.derive(graph)


# ---- tracing ----


def _capture_forward(
    model: nn.Module, args: tuple, kwargs: dict, found: blocks_mod.BlockList | None, traced: int
) -> Graph:
    """The forward graph, with the block list shortened to `traced` blocks while tracing."""
    with blocks_mod.shortened(model, found, traced):
        gm, kinds = _trace(model, args, kwargs)
        graph = _build(model, gm, kinds)
        return dataclasses.replace(graph, arguments=_arguments(model, args, kwargs, graph))


def _trace(model: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, list[tuple]]:
    """The model as a functional graph of dispatcher-level ATen operators, each node with its module path,
    and what each placeholder is: (kind, path or input name)."""
    args, kwargs = _to_model_device(model, args, kwargs)
    try:
        program = torch.export.export(model, args, kwargs, strict=False)
    except Exception as error:
        raise _capture_error(model, error, "torch.export") from error
    kinds = _placeholder_kinds(program)
    values = [node.meta["val"] for node in program.graph.nodes if node.op == "placeholder"]
    run = torch.fx.Interpreter(program.graph_module).run
    try:
        with preserve_node_meta():
            gm = make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="fake")(*values)
    except Exception as error:
        raise _capture_error(model, error, "the dispatcher-level trace") from error
    # Autograd's `detach`es of saved tensors and other unread results are not work to plan.
    gm.graph.eliminate_dead_code()
    return gm, kinds


def _to_model_device(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Example inputs on the device of the model's parameters: a model built on the meta device (too big to
    materialise) is traced with meta inputs, so nothing the size of a parameter is ever allocated."""
    first = next(iter(model.parameters()), None)
    if first is None or not first.is_meta:
        return args, kwargs
    to_meta = lambda t: t.to("meta")  # a meta copy holds no data
    return pytree.tree_map_only(torch.Tensor, to_meta, (args, kwargs))


def _placeholder_kinds(program: torch.export.ExportedProgram) -> list[tuple[str, str]]:
    """(kind, target) of every placeholder, in order: parameters, buffers and constants by path, user
    inputs by the argument's name."""
    names = {"PARAMETER": "parameter", "BUFFER": "buffer", "CONSTANT_TENSOR": "constant"}
    kinds = []
    for spec in program.graph_signature.input_specs:
        kind = names.get(spec.kind.name, "input")
        kinds.append((kind, spec.target if kind != "input" else spec.arg.name))
    return kinds


def _arguments(model: nn.Module, args: tuple, kwargs: dict, graph: Graph) -> dict[str, str]:
    """`Graph.arguments`: torch.export lifts the leaves of `(args, kwargs)` as user inputs in pytree order,
    so each input node is matched to its leaf's path; those one level deep are whole arguments."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    leaves = [(path, leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]  # `_build` keeps these
    inputs = [node.name for node in graph.nodes if node.kind == "input"]
    if len(leaves) != len(inputs):  # export dropped or added inputs: name none rather than guess
        return {}
    params = list(inspect.signature(model.forward).parameters.values())
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
    found = {}
    for name, (path, _) in zip(inputs, leaves, strict=True):
        if len(path) != 2:
            continue
        (where, key) = path
        if where.idx == 1:  # a keyword
            found[name] = key.key
        elif key.idx < len(named):
            found[name] = named[key.idx]
        else:
            found[name] = f"{rest}[{key.idx - len(named)}]"
    return found


def _capture_error(model: nn.Module, error: Exception, stage: str) -> CaptureError:
    """A `CaptureError` naming the innermost module of `model` whose forward was running when `error` was
    raised, the torch operator being called then (`Tensor.__bool__`: a tensor's value decides control flow),
    the model's line of code that raised it, the first line of the error, and the fallbacks."""
    paths = {id(module): path for path, module in model.named_modules()}
    torch_dir = os.path.dirname(torch.__file__)
    where, line, source, called = None, None, None, None
    trace = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            where = paths[id(owner)]
        if frame.f_code.co_name == "__torch_function__" and callable(frame.f_locals.get("func")):
            called = frame.f_locals["func"]  # the torch function tracing stopped in
        if not frame.f_code.co_filename.startswith((torch_dir, os.path.dirname(__file__))):
            line = f"{frame.f_code.co_filename}:{trace.tb_lineno}"
            source = linecache.getline(frame.f_code.co_filename, trace.tb_lineno).strip()
        trace = trace.tb_next
    place = ""
    if where is not None:
        owner = model.get_submodule(where)
        place = (
            f" in module {where!r} ({type(owner).__name__})"
            if where
            else f" in {type(model).__name__}.forward"
        )
    if called is not None:
        place += f" calling {_operator_name(called)}"
    if line is not None:
        place += f" at {line}" + (f" (`{source}`)" if source else "")
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CaptureError(
        f"cannot capture {type(model).__name__} for the automatic planner: {stage} failed{place}: "
        f"{type(error).__name__}: {first}. {FALLBACKS}."
    )


def _operator_name(func: Any) -> str:
    """`Tensor.__bool__`, `torch.nonzero`, `aten.nonzero.default`: how a user knows the operator."""
    if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(func)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    name = name.replace("TensorBase.", "Tensor.").replace("_TensorBase.", "Tensor.")
    module = getattr(func, "__module__", None)
    return f"torch.{name}" if module in ("torch", "torch._C._VariableFunctions") else name


# ---- building the Graph ----


def _build(model: nn.Module, gm: torch.fx.GraphModule, kinds: list[tuple[str, str]]) -> Graph:
    """The `Graph` of a traced module: sources from the placeholders, one op node per operator call
    (tuple outputs read through `Ref` indices, not `getitem` nodes)."""
    refs: dict[torch.fx.Node, Any] = {}  # fx node -> Ref, or tuple of Refs for a multi-output op
    nodes: list[Node] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(kinds), "the trace changed the inputs"
    taken: set[str] = set()
    for fx_node, (kind, target) in zip(placeholders, kinds, strict=True):
        if not isinstance(fx_node.meta.get("val"), torch.Tensor):
            # a number or flag among forward's arguments: the trace took its value as a constant
            if fx_node.users:
                raise ValueError(
                    f"capture: forward's input {target!r} is not a tensor and the traced graph still reads "
                    f"it; pass it as a tensor, or fix it with functools.partial before planning"
                )
            continue
        name = _unique(target, taken)
        nodes.append(Node(name=name, kind=kind, target=target, outputs=(tensor_info(fx_node.meta["val"]),)))
        refs[fx_node] = Ref(name)
    outputs: tuple = ()
    for fx_node in gm.graph.nodes:
        if fx_node.op == "call_function" and fx_node.target is operator.getitem:
            parent, index = fx_node.args
            refs[fx_node] = refs[parent][index]
        elif fx_node.op == "call_function" and not _skipped(fx_node):
            nodes.append(_op_node(fx_node, _unique(fx_node.name, taken), refs))
        elif fx_node.op == "output":
            outputs = tuple(_ref_or_none(item, refs) for item in pytree.tree_leaves(fx_node.args[0]))
    graph = Graph(model=type(model).__name__, nodes=tuple(nodes), params={}, outputs=outputs)
    return _with_params(graph, model)


def _skipped(fx_node: torch.fx.Node) -> bool:
    """Checks, and the copies functionalisation appends to write updated buffers back (a batch norm's
    running statistics): bookkeeping, not work to plan."""
    if str(fx_node.target) in _SKIPPED:
        return True
    first = fx_node.args[0] if fx_node.args else None
    return fx_node.target is torch.ops.aten.copy_.default and getattr(first, "op", "") == "placeholder"


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name_1`, `name_2`, ... when taken (a parameter `embedding` and an op `embedding`)."""
    unique, count = name, 0
    while unique in taken:
        count += 1
        unique = f"{name}_{count}"
    taken.add(unique)
    return unique


def _ref_or_none(item: Any, refs: dict) -> Ref | None:
    ref = refs.get(item) if isinstance(item, torch.fx.Node) else None
    return ref if isinstance(ref, Ref) else None


def _op_node(fx_node: torch.fx.Node, name: str, refs: dict) -> Node:
    """One op node: arguments with `Ref`s for tensors, outputs, module path, flops, bytes."""
    to_ref = lambda item: refs[item]
    args, kwargs = pytree.tree_map_only(torch.fx.Node, to_ref, (tuple(fx_node.args), dict(fx_node.kwargs)))
    inputs = tuple(leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Ref))
    value = fx_node.meta.get("val")
    values = value if isinstance(value, list | tuple) else (value,)
    outputs = tuple(tensor_info(v) if isinstance(v, torch.Tensor) else None for v in values)
    if isinstance(value, list | tuple):
        refs[fx_node] = tuple(Ref(name, i) for i in range(len(values)))
    else:
        refs[fx_node] = Ref(name)
    module, module_type = _module_of(fx_node)
    op = fx_node.target
    to_value = lambda item: item.meta.get("val")
    values_args, values_kwargs = pytree.tree_map_only(
        torch.fx.Node, to_value, (tuple(fx_node.args), dict(fx_node.kwargs))
    )
    input_infos = [tensor_info(t) for t in tensors_in((values_args, values_kwargs))]
    return Node(
        name=name,
        kind="op",
        target=str(op),
        op=op,
        args=args,
        kwargs=kwargs,
        inputs=inputs,
        outputs=outputs,
        module=module,
        module_type=module_type,
        flops=op_flops(op, values_args, values_kwargs, value),
        bytes=op_bytes(op, input_infos, outputs),
    )


def _module_of(fx_node: torch.fx.Node) -> tuple[str, str]:
    """The innermost module path and class name from the node's `nn_module_stack` ("" for the root)."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return blocks_mod.normalise_path(path), kind.rsplit(".", 1)[-1]


def _with_params(graph: Graph, model: nn.Module) -> Graph:
    """The graph with its `params`: each parameter and buffer node's owner module, aliases (tied
    weights), direct users and first non-view consumers."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        by_id.setdefault(id(tensor), []).append(name)
    aliases = {name: tuple(n for n in names if n != name) for names in by_id.values() for name in names}
    # every name of a tied parameter: export may lift each name as its own input
    trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    params = {}
    for node in graph.nodes:
        if node.kind not in ("parameter", "buffer"):
            continue
        owner = node.target.rpartition(".")[0]
        params[node.target] = Param(
            name=node.target,
            kind=node.kind,
            node=node.name,
            info=node.output(),
            module=owner,
            module_type=type(model.get_submodule(owner)).__name__,
            trainable=node.target in trainable,
            aliases=aliases.get(node.target, ()),
            users=graph.users(node.name),
            consumers=_consumers(graph, node.name),
            one_input=_takes_one_input(model.get_submodule(owner)),
        )
    return dataclasses.replace(graph, params=params)


def _takes_one_input(module: nn.Module) -> bool:
    """True when `module.forward` takes exactly one positional argument and no more (no *args)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C-implemented forward: say nothing about it
        return False
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(kind in positional for kind in kinds) == 1


def _consumers(graph: Graph, name: str) -> tuple[str, ...]:
    """The first non-view op nodes reading `name`, looking through views (`t`, `view`, `expand`)."""
    found: list[str] = []
    todo = list(graph.users(name))
    while todo:
        user = graph[todo.pop(0)]
        if user.op is not None and getattr(user.op, "is_view", False):
            todo.extend(graph.users(user.name))
        elif user.name not in found:
            found.append(user.name)
    return tuple(found)
