"""Reference models used by the examples, the demo and the tests."""

from loom.models.doc_examples import (
    MatMulChain,
    ReluNet,
    SoftCrossEntropy,
    WithLoss,
    example_batches,
    train_sgd,
)
from loom.models.mlp import MLP, MLPRegression

__all__ = [
    "MLP",
    "MLPRegression",
    "MatMulChain",
    "ReluNet",
    "SoftCrossEntropy",
    "WithLoss",
    "example_batches",
    "train_sgd",
]
