"""A plain multi-layer perceptron (no loom code inside): the model of data-parallel tests and benchmarks."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    """`depth` linear layers of width `width` with GELU between them."""

    def __init__(self, d_in: int, width: int, d_out: int, depth: int = 2) -> None:
        sizes = [d_in] + [width] * (depth - 1) + [d_out]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
            layers.append(nn.Linear(a, b))
            if i < depth - 1:
                layers.append(nn.GELU())
        super().__init__(*layers)
