"""Repeated blocks: finding a model's block list, tracing only the first blocks of a deep model, and
grouping the traced operators by block.

Where the block list is: the path the caller gives; else the model's recipe (`loom.models.recipes`: loom's
GPT, Hugging Face GPT-2, Llama, Mixtral); else the first of the usual paths (`model.layers`,
`transformer.h`, ...); else the `ModuleList` (or `Sequential`) with the most parameters whose children are
structurally identical. Structurally identical (`module_signature`): the same classes, submodule names,
parameter and buffer shapes and dtypes, and plain settings (numbers, strings, flags; a per-layer index such
as `layer_idx` aside), so a model alternating sliding-window and full attention layers is not taken for a
list of identical blocks.

A list of identical blocks is traced with its first `trace_blocks` blocks only (`shortened`). After the
trace every op node is assigned to the block whose module path it runs under, and each traced block's op
sequence is hashed (operators, module paths relative to the block, shapes, non-tensor arguments, and where
each input comes from): blocks whose hashes agree are one repeated block. Operators between the blocks
(outside every block, after the first and before the last) may run between some blocks only, so a
shortened trace that finds any is redone with every block. Work that runs only after later blocks (after
every second block, from the second on) is not seen by a two-block trace: it counts once, as work after
the blocks; `capture(..., trace_blocks=n)` traces more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn
from torch.utils import _pytree as pytree

from loom.models.recipes import BLOCK_PATHS, find_blocks, known_recipe
from loom.plan.graph import Blocks, Graph, Node, Ref

__all__ = [
    "BlockList", "assign_blocks", "find_block_list", "module_signature", "normalise_path", "repeats", "shortened",
]  # fmt: skip

# Per-layer numbers that differ between otherwise identical blocks (Hugging Face's `layer_idx`).
_INDEX_ATTRIBUTE = re.compile(r"(^|_)(idx|index|id|layer_number|layer_num)$")


@dataclass(frozen=True, kw_only=True)
class BlockList:
    """A model's block list: its path, how many blocks, and whether they are structurally identical."""

    path: str
    count: int
    identical: bool

    def traced_count(self, trace_blocks: int) -> int:
        """How many blocks to trace: `trace_blocks` of identical blocks (at least 1), else all of them."""
        if trace_blocks < 1:
            raise ValueError(f"trace_blocks = {trace_blocks}: trace at least 1 block")
        if self.identical and self.path:
            return min(trace_blocks, self.count)
        return self.count


def find_block_list(model: nn.Module, path: str | None = None) -> BlockList | None:
    """The model's block list (see the module notes), None when it has none."""
    if path is not None:
        path, found = find_blocks(model, path)
        return _block_list(path, found)
    recipe = known_recipe(model)
    if recipe is not None:
        return _block_list(recipe.blocks, model.get_submodule(recipe.blocks))
    for candidate in BLOCK_PATHS:
        try:
            path, found = find_blocks(model, candidate)
        except ValueError:
            continue
        listed = _block_list(path, found)
        if listed.identical:
            return listed
    return _largest_identical_list(model)


def _block_list(path: str, blocks: nn.Module) -> BlockList:
    children = list(blocks.children())
    signatures = {module_signature(child) for child in children}
    return BlockList(path=path, count=len(children), identical=len(children) >= 2 and len(signatures) == 1)


def _largest_identical_list(model: nn.Module) -> BlockList | None:
    """The list of identical modules (two or more) holding the most parameters, None if there is none."""
    best, best_size = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        listed = _block_list(path, module)
        size = sum(p.numel() for p in module.parameters())
        if listed.identical and size > best_size:
            best, best_size = listed, size
    return best


def module_signature(module: nn.Module) -> tuple:
    """What makes two blocks the same computation: classes, names, tensor shapes, plain settings."""
    parts = []
    for name, sub in module.named_modules():
        settings = tuple(
            sorted(
                (key, value)
                for key, value in vars(sub).items()
                if isinstance(value, int | float | str | bool | type(None))
                and not key.startswith("_")
                and not _INDEX_ATTRIBUTE.search(key)
            )
        )
        parts.append((name, type(sub).__qualname__, settings))
    tensors = [*module.named_parameters(), *module.named_buffers()]
    parts.extend((name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in tensors)
    return tuple(parts)


@contextmanager
def shortened(model: nn.Module, found: BlockList | None, count: int) -> Iterator[None]:
    """Within the block, the model's block list holds only its first `count` blocks (restored after)."""
    if found is None or count >= found.count:
        yield
        return
    parent_path, _, leaf = found.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    original = getattr(parent, leaf)
    if isinstance(original, nn.Sequential):
        short: nn.Module = nn.Sequential(OrderedDict(list(original.named_children())[:count]))
    else:
        short = nn.ModuleList(list(original.children())[:count])
    setattr(parent, leaf, short)
    try:
        yield
    finally:
        setattr(parent, leaf, original)


def normalise_path(path: str) -> str:
    """A module path as `named_modules` writes it (`layers.0.mlp`), from the forms tracers record
    (`L['self'].layers[0].mlp`, `L__self___layers_0`)."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).strip(".")


def assign_blocks(graph: Graph, found: BlockList, traced: int) -> Graph:
    """The graph with each op node's `block` set and, when every traced block runs the same operators on
    the same shapes, its `Blocks`."""
    prefixes = [f"{found.path}.{i}" for i in range(traced)] if found.path else [str(i) for i in range(traced)]
    nodes = []
    for node in graph.nodes:
        block = _block_of(node, prefixes)
        nodes.append(dataclasses.replace(node, block=block) if block is not None else node)
    graph = dataclasses.replace(graph, nodes=tuple(nodes), blocks=None)
    members = [tuple(n.name for n in graph.ops() if n.block == i) for i in range(traced)]
    if not all(members):
        return graph
    signatures = {_block_signature(graph, names, prefixes[i]) for i, names in enumerate(members)}
    if len(signatures) != 1:
        return graph
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    first, last = order[members[0][0]], order[members[-1][-1]]
    outside = [n.name for n in graph.ops() if n.block is None]
    blocks = Blocks(
        path=found.path,
        count=found.count,
        traced=traced,
        signature=signatures.pop(),
        nodes=tuple(members),
        before=tuple(name for name in outside if order[name] < first),
        between=tuple(name for name in outside if first < order[name] < last),
        after=tuple(name for name in outside if order[name] > last),
    )
    return dataclasses.replace(graph, blocks=blocks)


def repeats(graph: Graph) -> bool:
    """Whether the traced blocks stand for all of them: they are identical and nothing runs between them
    (work between blocks, on some of them only, is known only from a trace of every block)."""
    return graph.blocks is not None and not graph.blocks.between


def _block_of(node: Node, prefixes: list[str]) -> int | None:
    if not node.is_op:
        return None
    for index, prefix in enumerate(prefixes):
        if node.module == prefix or node.module.startswith(prefix + "."):
            return index
    return None


def _block_signature(graph: Graph, names: tuple[str, ...], prefix: str) -> str:
    """A short hash of a block's op sequence: operators, module paths relative to the block, shapes,
    non-tensor arguments, and for each input either its position within the block or its source kind."""
    position = {name: i for i, name in enumerate(names)}

    def where(ref: Ref) -> str:
        if ref.node in position:
            return f"#{position[ref.node]}.{ref.index}"
        source = graph[ref.node]
        return f"{source.kind}:{source.outputs[ref.index]!r}"

    text = []
    for name in names:
        node = graph[name]
        relative = node.module[len(prefix) :]
        plain = pytree.tree_map_only(Ref, lambda _: "tensor", (node.args, node.kwargs))
        text.append((node.target, relative, node.outputs, [where(r) for r in node.inputs], repr(plain)))
    return hashlib.sha1(repr(text).encode()).hexdigest()[:12]
