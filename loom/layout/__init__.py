"""Strategies and Layouts compiled to DTensor placements on loom's canonical mesh."""

from loom.layout.compile import compile_inputs, compile_operator
from loom.layout.named import Layout, TensorMap
from loom.layout.redistribute import as_replicated, full, layout_of, to_layout
from loom.layout.strategy import compile_strategy
from loom.layout.tensor_layout import TensorLayout, align_device_matrix

__all__ = [
    "Layout",
    "TensorLayout",
    "TensorMap",
    "align_device_matrix",
    "as_replicated",
    "compile_inputs",
    "compile_operator",
    "compile_strategy",
    "full",
    "layout_of",
    "to_layout",
]
