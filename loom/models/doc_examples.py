"""The two networks of MindSpore's semi-automatic parallelism documentation, written with loom.ops."""

from __future__ import annotations

import torch
from torch import nn

import loom
from loom import ops


class MatMulChain(nn.Module):
    """`Z = (X W) V`: the first matmul cuts X by rows (data parallel), the second V by columns (model
    parallel), so loom must move the hidden activation from a row layout to a replicated one in between."""

    def __init__(self, d_in: int = 8, d_hidden: int = 12, d_out: int = 16, parts: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_hidden))
        self.v = nn.Parameter(torch.randn(d_hidden, d_out))
        self.matmul1 = ops.MatMul().shard(((parts, 1), (1, 1)))
        self.matmul2 = ops.MatMul().shard(((1, 1), (1, parts)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul2(self.matmul1(x, self.w), self.v)


class ReluNet(nn.Module):
    """`relu(x @ weight)` with the matmul's contracted dim cut in two and the relu cut by rows."""

    def __init__(self, d_in: int = 32, d_out: int = 16, parts: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.normal(0.0, 1.0, (d_in, d_out)))
        self.matmul = ops.MatMul().shard(((1, parts), (parts, 1)))
        self.relu = ops.ReLU().shard(((parts, 1),))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.matmul(x, self.weight))


class SoftCrossEntropy(nn.Module):
    """Softmax cross-entropy against soft labels, averaged over the batch (MindSpore's
    `SoftmaxCrossEntropyWithLogits(sparse=False, reduction="mean")`)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return -(labels * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


class WithLoss(nn.Module):
    """A network followed by its loss: `forward(x, label) -> loss` (MindSpore's `WithLossCell`)."""

    def __init__(self, net: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.net, self.loss = net, loss

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x), label)


def example_batches(steps: int = 4, batch: int = 16, d_in: int = 32, d_out: int = 16, seed: int = 1) -> list:
    """Uniform random inputs and labels, the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(batch, d_in, generator=generator), torch.rand(batch, d_out, generator=generator))
            for _ in range(steps)]  # fmt: skip


def train_sgd(
    model: nn.Module, batches: list, epochs: int = 5, lr: float = 1e-3, momentum: float = 0.1
) -> list:
    """Momentum SGD over `batches` for `epochs`; the loss of every step (the global loss on every rank)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(epochs):
        for x, label in batches:
            loss = model(x, label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loom.full(loss).item())
    return losses
