"""MindSpore-style primitives with `.shard(in_strategy, out_strategy=None)`."""

from loom.ops.primitive import Primitive
from loom.ops.primitives import (
    GELU,
    Add,
    BatchMatMul,
    Div,
    Gather,
    Identity,
    LayerNorm,
    MatMul,
    Mul,
    ReduceMean,
    ReduceSum,
    ReLU,
    Reshape,
    Softmax,
    Sub,
    Transpose,
)
from loom.ops.trace import Recording, record

__all__ = [
    "GELU",
    "Add",
    "BatchMatMul",
    "Div",
    "Gather",
    "Identity",
    "LayerNorm",
    "MatMul",
    "Mul",
    "Primitive",
    "ReLU",
    "Recording",
    "ReduceMean",
    "ReduceSum",
    "Reshape",
    "Softmax",
    "Sub",
    "Transpose",
    "record",
]
