"""A model for `loom plan --model examples.plan_any_model:build`: any PyTorch module planned at the operator
level (docs/planner.md, "`loom plan` for any model"). Run from the repository root:

    loom plan --model examples.plan_any_model:build --hardware h100-sxm --gpus 8 --memory-limit 4

`build()` is called on the meta device, so the 0.8B parameters below take no memory here.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """Features in, `layers` identical blocks, a regression head; the forward returns the squared error."""

    def __init__(self, features: int, width: int, layers: int, targets: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, targets)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h), y)


def build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (24 blocks of width 2048: 0.81B parameters) and one step's batch of 512 rows: dim 0 of each
    input is the batch, which `--global-batch` resizes and the data-parallel ranks split."""
    model = ResidualMLP(features=1024, width=2048, layers=24, targets=16)
    return model, (torch.randn(512, 1024), torch.randn(512, 16))
