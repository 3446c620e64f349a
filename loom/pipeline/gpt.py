"""The reference GPT cut into pipeline stages: embedding on the first stage, final norm and logits on the last.

`GPTStage` borrows the GPT's own submodules and parameters (nothing is copied), so a stage trains the very
tensors of the model it came from and its parameters keep the model's names through `source_names`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loom.models.gpt import GPT, vocab_parallel_cross_entropy
from loom.pipeline.stages import group_blocks


class GPTStage(nn.Module):
    """Blocks `block_indices` of `model`, plus the embedding when `first` and the head when `last`.

    The first stage takes token ids (batch, seq); the others the residual stream (batch, seq, d_model); the
    last returns logits (batch, seq, vocab).
    """

    def __init__(self, model: GPT, block_indices: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        if model.config.tie_embeddings and not (first and last):
            raise ValueError(
                "a GPT with tie_embeddings=True shares its embedding between the first and the last "
                "pipeline stage, which is not supported yet: build it with GPTConfig(tie_embeddings=False)"
            )
        if model.config.positions != "learned":
            raise ValueError("pipeline stages of the GPT support positions='learned' only for now")
        self.first, self.last, self.block_indices = first, last, list(block_indices)
        self.blocks = nn.ModuleList(model.blocks[i] for i in block_indices)
        if first:
            self.embedding, self.positions = model.embedding, model.positions
            self.lookup, self.add_positions = model.lookup, model.add_positions
        if last:
            self.norm, self.logits = model.norm, model.logits
            self.head = model.embedding if model.config.tie_embeddings else model.head
        self.register_buffer("causal_mask", model.causal_mask.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        if self.first:
            x = self.add_positions(self.lookup(self.embedding, x), self.positions[:seq])
        mask = self.causal_mask[:seq, :seq]
        for block in self.blocks:
            x = block(x, mask, None)
        if self.last:
            x = self.logits(self.norm(x), self.head)
        return x


def split_gpt(model: GPT, stage_of_block: Sequence[int] | None = None) -> list[GPTStage]:
    """All stages of `model`: blocks grouped by `stage_of_block` (default: the blocks' `pipeline_stage`
    marks, validated)."""
    if stage_of_block is not None:
        for block, k in zip(model.blocks, stage_of_block, strict=True):
            block.pipeline_stage = k
    groups = group_blocks(list(model.blocks))
    last = len(groups) - 1
    return [GPTStage(model, g, first=k == 0, last=k == last) for k, g in enumerate(groups)]


def source_names(model: GPT, stage: nn.Module) -> list[str]:
    """The model's name of each of `stage`'s parameters (in `stage.parameters()` order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in stage.parameters()]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's mean cross-entropy, as the last stage's loss function."""
    return vocab_parallel_cross_entropy(logits, targets)
