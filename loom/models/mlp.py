"""A plain multi-layer perceptron (no loom code inside): the model of data-parallel tests and benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class MLPRegression(nn.Module):
    """An MLP whose layers sit in an `nn.ModuleList` (one unit each for optimizer level 3 or FSDP2);
    `forward(x, y)` returns the mean squared error."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlp)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, y)
