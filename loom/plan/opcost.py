"""What a cost function needs to know about one operator: its flops and the bytes it moves, and the tensor
descriptions (`TensorInfo`) they are computed from. No prices here: `loom.cost` turns these into seconds.

Flops come from `torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention), which read only
shapes, so they run on meta tensors; an operator without a formula counts 0 flops (it is memory-bound,
priced by its bytes). CPU flash attention has no formula of its own: it does the work of flash attention,
so it borrows that formula. Bytes are every tensor input read once plus every output written once; views
move nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from loom.plan.graph import TensorInfo

__all__ = ["meta_tensor", "op_bytes", "op_flops", "tensor_info"]

aten = torch.ops.aten

# Operators counted with another operator's formula, on their first `n` arguments (the shapes the
# formula reads): CPU kernels of operators whose GPU kernels have formulas.
_BORROWED = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (aten._scaled_dot_product_flash_attention, 3),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": (
        aten._scaled_dot_product_flash_attention_backward,
        4,
    ),
}


# Operators whose first input is a table they read only some rows of.
_LOOKUPS = {"aten.embedding.default", "aten.index_select.default"}


def tensor_info(value: torch.Tensor) -> TensorInfo:
    """The `TensorInfo` of a tensor (real, fake or meta)."""
    return TensorInfo(
        shape=tuple(int(s) for s in value.shape),
        stride=tuple(int(s) for s in value.stride()),
        dtype=str(value.dtype).removeprefix("torch."),
        itemsize=value.element_size(),
    )


def meta_tensor(info: TensorInfo, shape: Sequence[int] | None = None) -> torch.Tensor:
    """A meta tensor (no data) like `info`, or of another `shape` with contiguous strides."""
    dtype = getattr(torch, info.dtype)
    if shape is not None:
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    return torch.empty_strided(info.shape, info.stride, dtype=dtype, device="meta")


def op_flops(op: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    """Floating-point operations of `op(*args, **kwargs) -> out` (tensors real, fake or meta), 0 when
    `torch.utils.flop_counter` has no formula for it."""
    borrowed = _BORROWED.get(str(op))
    if borrowed is not None:
        packet, count = borrowed
        return int(flop_registry[packet](*args[:count], out_val=None))
    formula = flop_registry.get(getattr(op, "overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def op_bytes(op: Any, inputs: Sequence[TensorInfo | None], outputs: Sequence[TensorInfo | None]) -> int:
    """Bytes read and written: every tensor input once and every output once; 0 for a view. A lookup
    (`embedding`, `index_select`) reads only the rows it gathers: as many bytes as it writes."""
    if getattr(op, "is_view", False):
        return 0
    written = sum(info.nbytes for info in outputs if info is not None)
    if str(op) in _LOOKUPS and inputs and inputs[0] is not None:
        inputs = [None, *inputs[1:]]
        written *= 2
    return written + sum(info.nbytes for info in inputs if info is not None)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of an argument structure, in order."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
