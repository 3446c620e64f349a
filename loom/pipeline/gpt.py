"""The reference GPT cut into pipeline stages: embedding on the first stage, final norm and logits on the
last.

`GPTStage` borrows the GPT's own submodules and parameters (nothing is copied), so a stage trains the very
tensors of the model it came from and its parameters keep the model's names through `source_names`.
`gpt_pipeline` builds one rank's part of a pipeline on a mesh's pp axis; from a GPT on the meta device it
allocates and initialises only that rank's stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loom.dist.mesh import Mesh
from loom.models.gpt import GPT, vocab_parallel_cross_entropy
from loom.pipeline.schedule import SCHEDULES, Pipeline, Tied, stage_indices
from loom.pipeline.stages import balanced_partition, group_blocks


class GPTStage(nn.Module):
    """Blocks `block_indices` of `model`, plus the embedding when `first` and the head when `last`.

    The first stage takes token ids (batch, seq); the others the residual stream (batch, seq, d_model); the
    last returns logits (batch, seq, vocab). With tied embeddings the last stage's head is the model's
    `embedding` (on another rank, that rank's copy: see `Tied`).
    """

    def __init__(self, model: GPT, block_indices: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
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


def stage_parameters(model: GPT, stages: Sequence[nn.Module]) -> nn.Module:
    """A module that holds the parameters of `stages` (the very tensors) under the model's names, empty
    modules in between: its `state_dict` is this rank's part of the whole model's, which is what a
    checkpoint saves, so that it loads on any other split of the model."""
    root = nn.Module()
    for stage in stages:
        for name, param in zip(source_names(model, stage), stage.parameters(), strict=True):
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, param)
    return root


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's mean cross-entropy, as the last stage's loss function."""
    return vocab_parallel_cross_entropy(logits, targets)


def rank_stages(model: GPT, schedule: str, pp: int, pp_rank: int, virtual: int = 1) -> list[GPTStage]:
    """The stages that pipeline rank `pp_rank` holds, in `Pipeline`'s order: the blocks cut into
    `pp * virtual` stages balanced by block count (the blocks are alike)."""
    if pp * virtual > len(model.blocks):
        raise ValueError(
            f"{pp * virtual} pipeline stages ({pp} ranks x {virtual} per rank) for {len(model.blocks)} "
            f"blocks: every stage needs a block; lower pp or add layers"
        )
    stages = split_gpt(model, balanced_partition([1.0] * len(model.blocks), pp * virtual))
    return [stages[k] for k in stage_indices(schedule, pp_rank, pp, virtual)]


def materialize_stages(
    model: GPT, stages: Sequence[GPTStage], *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[GPTStage]:
    """`stages` of a GPT built on the meta device, rebuilt with only their parameters (and the model's
    constant tables) allocated on `device` and initialised by `GPT.init_weights(seed)`, which seeds each
    parameter by its name: the values are those of the whole model built on one device."""
    for name in [n for stage in stages for n in source_names(model, stage)]:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        meta = getattr(module, leaf)
        setattr(module, leaf, nn.Parameter(torch.empty_like(meta, device=device), meta.requires_grad))
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.empty_like(buffer, device=device))
    model.init_weights(seed)  # parameters still on the meta device (other ranks' stages) are skipped
    return [GPTStage(model, s.block_indices, first=s.first, last=s.last) for s in stages]


def gpt_pipeline(
    model: GPT, mesh: Mesh, *, schedule: str, microbatches: int, virtual: int = 1, seed: int = 0
) -> Pipeline:
    """This rank's part of `model` as a pipeline over `mesh`'s `"pp"` axis, its stages' gradients averaged
    over the `"dp"` axis. A model on the meta device gets only this rank's stages materialised (see
    `materialize_stages`). The stages compute on this process alone (tp = 1): run them with no current
    mesh (`loom.dist.context.unsharded`, as `PipelineTrainer` does), so that their operators' strategies
    are ignored."""
    pp = mesh.axis_size("pp")
    if pp == 1:
        raise ValueError(f"a pipeline needs a mesh with a 'pp' axis of size > 1, got {mesh}")
    stages = rank_stages(model, schedule, pp, mesh.axis_rank("pp"), virtual)
    if any(p.is_meta for stage in stages for p in stage.parameters()):
        stages = materialize_stages(model, stages, seed=seed)
    return Pipeline(
        stages,
        schedule=schedule,
        microbatches=microbatches,
        loss_fn=gpt_loss,
        group=mesh.axis_group("pp"),
        dp_group=mesh.axis_group("dp"),
        tied=tied_embedding(model, stages, schedule),
    )


def tied_embedding(model: GPT, stages: Sequence[GPTStage], schedule: str) -> list[Tied]:
    """The embedding as a `Tied` parameter when the model ties it to the head and the first and the last
    stage sit on different ranks (a V placement puts both on rank 0, where they share one tensor)."""
    if not model.config.tie_embeddings or SCHEDULES[schedule].placement == "v":
        return []
    holds = any(stage.first or stage.last for stage in stages)
    table = model.embedding
    return [Tied(param=table if holds else None, shape=table.shape, dtype=table.dtype, holders=2)]
