"""The reference GPT cut into pipeline stages: embedding on the first stage, final norm and logits on the
last.

A stage is a `BlockStage` of the GPT's recipe (`loom.models.recipes.gpt_recipe`): it borrows the GPT's own
submodules and parameters (nothing is copied), so a stage trains the very tensors of the model it came from
and its parameters keep the model's names through `source_names`.
`gpt_pipeline` builds one rank's part of a pipeline on a mesh's pp axis; from a GPT on the meta device it
allocates and initialises only that rank's stages.

With a "tp" axis (tp x pp, dp x tp x pp), each stage is laid out by `parallelize_part` on its own stage
mesh, the dp x tp ranks that share its pp index (`Mesh.without("pp")`), so that no collective of a stage
ever spans pipeline ranks (which hold other stages). torch's schedules move plain tensors between stages:
a stage's input is this rank's piece of the residual stream (its rows of the batch; with sequence
parallelism also its cut of the sequence), made a DTensor on entry and its local piece again on exit.

`whole_gpt` gathers a trained pipeline's parameters into the whole model on every rank, to sample from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.dist.mesh import Mesh
from loom.layout.parameters import materialize
from loom.layout.redistribute import full
from loom.models.gpt import GPT, vocab_parallel_cross_entropy
from loom.models.recipes import gpt_recipe
from loom.parallel.context import chunk_count
from loom.parallel.parallelize import parallelize_part
from loom.parallel.pipeline.blocks import BlockStage, rank_pipeline, source_names
from loom.parallel.pipeline.schedule import Pipeline, stage_indices
from loom.parallel.pipeline.stages import balanced_partition, group_blocks
from loom.parallel.pipeline.tensor_stages import enter_stream, local_share, stream_placements


def gpt_stage(model: GPT, block_indices: Sequence[int], *, first: bool, last: bool) -> BlockStage:
    """Blocks `block_indices` of `model`, plus the embedding when `first` and the head when `last`, as the
    GPT's recipe (`loom.models.recipes.gpt_recipe`) places them.

    The first stage takes token ids (batch, seq); the others the residual stream (batch, seq, d_model); the
    last returns logits (batch, seq, vocab). With tied embeddings the last stage's head is the model's
    `embedding` (on another rank, that rank's copy: see `Tied`). Positions are learned (a table on the first
    stage) or rotary (every block rotates its queries and keys by the model's tables). The model's constant
    tables (causal mask, rotary tables) are shared, not copied."""
    return BlockStage(model, gpt_recipe(model), block_indices, first=first, last=last)


def split_gpt(model: GPT, stage_of_block: Sequence[int] | None = None) -> list[BlockStage]:
    """All stages of `model`: blocks grouped by `stage_of_block` (default: the blocks' `pipeline_stage`
    marks, validated)."""
    if stage_of_block is not None:
        for block, k in zip(model.blocks, stage_of_block, strict=True):
            block.pipeline_stage = k
    groups = group_blocks(list(model.blocks))
    last = len(groups) - 1
    return [gpt_stage(model, g, first=k == 0, last=k == last) for k, g in enumerate(groups)]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's mean cross-entropy, as the last stage's loss function."""
    return vocab_parallel_cross_entropy(logits, targets)


def sharded_gpt_loss(mesh: Mesh):
    """The last stage's loss function on a stage mesh: the vocab-parallel cross-entropy of the logits
    (a DTensor) against this rank's rows of the targets, as this rank's plain share of the mean over the
    micro-batch's rows of every data-parallel replica (`local_share`). Its backward gives each replica the
    gradient of that global mean, so the stages' gradients are summed over the replicas (pending sums, as
    in `loom.parallelize`)."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = DTensor.from_local(
            targets, mesh.device_mesh, stream_placements(mesh, False), run_check=False
        )
        return local_share(vocab_parallel_cross_entropy(logits, targets))

    return loss


def rank_stages(
    model: GPT, schedule: str, pp: int, pp_rank: int, virtual: int = 1, split: Sequence[int] | None = None
) -> list[BlockStage]:
    """The stages that pipeline rank `pp_rank` holds, in `Pipeline`'s order: the blocks cut into
    `pp * virtual` stages, `split[k]` blocks in stage k (uneven allowed), or balanced by block count."""
    stages = gpt_stages(model, pp * virtual, split)
    return [stages[k] for k in stage_indices(schedule, pp_rank, pp, virtual)]


def gpt_stages(model: GPT, count: int, split: Sequence[int] | None = None) -> list[BlockStage]:
    """All `count` stages of `model` in model order: `split[k]` blocks in stage k, or balanced."""
    blocks = len(model.blocks)
    if count > blocks:
        raise ValueError(
            f"{count} pipeline stages for {blocks} blocks: every stage needs a block; lower pp or add layers"
        )
    if split is None:
        return split_gpt(model, balanced_partition([1.0] * blocks, count))
    if len(split) != count or sum(split) != blocks or min(split) < 1:
        raise ValueError(
            f"stages {list(split)}: give {count} block counts (pp x stages per rank), each >= 1, that add up "
            f"to the model's {blocks} blocks"
        )
    return split_gpt(model, [k for k, n in enumerate(split) for _ in range(n)])


def materialize_stages(
    model: GPT, stages: Sequence[BlockStage], *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[BlockStage]:
    """`stages` of a GPT built on the meta device, rebuilt with only their parameters (and the model's
    constant tables) allocated on `device` and initialised by `GPT.init_weights(seed)`, which seeds each
    parameter by its name: the values are those of the whole model built on one device."""
    for name in [n for stage in stages for n in source_names(model, stage)]:
        meta = model.get_parameter(name)
        _set(model, name, nn.Parameter(torch.empty_like(meta, device=device), meta.requires_grad))
    _materialize_buffers(model, device)
    model.init_weights(seed)  # parameters still on the meta device (other ranks' stages) are skipped
    return [gpt_stage(model, s.block_indices, first=s.first, last=s.last) for s in stages]


def shard_stages(
    model: GPT, stages: Sequence[BlockStage], mesh: Mesh, *, seed: int = 0, device: torch.device | str = "cpu"
) -> list[BlockStage]:
    """`stages` of a GPT built on the meta device with its tensor-parallel `Strategies`, each laid out on
    the stage mesh `mesh` by `parallelize_part` (semi_auto: a dry run decides every parameter's layout),
    with only this rank's shards allocated and initialised by `GPT.init_weights(seed)` (the values of the
    whole model on one device). Gradients are left pending: the pipeline's one `GradSync` reduces them (see
    `loom.parallel.pipeline.reduction`)."""
    s = model.strategies
    if (s.dp, s.cp, s.tp) != (mesh.dp_size, mesh.axis_size("cp"), mesh.axis_size("tp")):
        raise ValueError(
            f"the GPT's Strategies are for dp {s.dp} x cp {s.cp} x tp {s.tp} but the stage mesh is {mesh}: "
            f"build the GPT with Strategies(dp={mesh.dp_size}, tp={mesh.axis_size('tp')}, "
            f"cp={mesh.axis_size('cp')}, ...)"
        )
    _materialize_buffers(model, device)
    stages = [gpt_stage(model, st.block_indices, first=st.first, last=st.last) for st in stages]
    names = [source_names(model, stage) for stage in stages]
    for stage in stages:  # each laid out on the stage mesh, given explicitly
        # the first stage checks each shape of its input once (the schedule keeps the shapes from run to run)
        example = (_example_input(model, stage),)
        parallelize_part(stage, mesh, example_inputs=example, check_once_per_shape=True)
        stage.loom.grad_sync.remove()  # one GradSync serves all of this rank's stages (Pipeline's)
        materialize(stage, device)
        stage.boundary = stream_placements(mesh, s.sequence_parallel)
        if not stage.first:  # before parallelize's hook, which would replicate the sequence over tp
            stage.register_forward_pre_hook(enter_stream(mesh, stage.boundary), prepend=True)
    for stage, stage_names in zip(stages, names, strict=True):  # the model (init_weights) sees the shards
        for (path, param), name in zip(list(stage.named_parameters()), stage_names, strict=True):
            if not isinstance(model.get_parameter(name), DTensor):
                _set(model, name, param)
            _set(stage, path, model.get_parameter(name))  # one tensor for a table two stages share
    model.init_weights(seed)  # this rank's shards; other ranks' stages are still on the meta device
    return stages


def _example_input(model: GPT, stage: BlockStage) -> torch.Tensor:
    """One row of what `stage` takes (token ids or the residual stream), for parallelize's dry run: with
    context parallelism this rank's piece of the longest sequence that cuts evenly over cp."""
    s, seq = model.strategies, model.config.max_seq_len
    if s.cp > 1:
        chunks = chunk_count(s.cp, s.sequence_layout)
        seq = seq // chunks * chunks // s.cp
    if stage.first:
        return torch.zeros(1, seq, dtype=torch.long, device="meta")
    return torch.zeros(1, seq, model.config.d_model, device="meta")


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` (a parameter or a buffer) at dotted `name` in `module`."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, tensor)


def _materialize_buffers(model: GPT, device: torch.device | str) -> None:
    """Allocate the model's constant tables on `device` (filled by `init_weights`)."""
    for name, buffer in list(model.named_buffers()):
        _set(model, name, torch.empty_like(buffer, device=device))


def gpt_pipeline(
    model: GPT, mesh: Mesh, *, schedule: str, microbatches: int, virtual: int = 1, seed: int = 0,
    bucket_mb: float = 25.0, split: Sequence[int] | None = None,
) -> Pipeline:  # fmt: skip
    """This rank's part of `model` as a pipeline over `mesh`'s `"pp"` axis, its stages' gradients averaged
    over the `"dp"` axis in buckets of about `bucket_mb` megabytes; `split`: blocks per stage (uneven
    allowed), else balanced. A model on the meta device gets only
    this rank's stages materialised (see `materialize_stages`).

    Without a "tp" axis the stages compute on this process alone: run them with no current mesh
    (`loom.dist.context.unsharded`, as the `Trainer` does for a pipeline), so that their operators' strategies are
    ignored. With one, or with experts (`GPTConfig.experts`) on several data-parallel replicas, `model` must
    be on the meta device, built with `Strategies` for the mesh's dp and tp (and `ep`: the experts cut over
    ep ranks of each stage's dp); its stages are laid out on the stage mesh (`shard_stages`), on which their
    primitives then compute (`parallelize_part` binds them to it and connects each stage's experts to their
    exchange over the stage's ep ranks)."""
    pp = mesh.axis_size("pp")
    if pp == 1:
        raise ValueError(f"a pipeline needs a mesh with a 'pp' axis of size > 1, got {mesh}")
    stages = rank_stages(model, schedule, pp, mesh.axis_rank("pp"), virtual, split)
    stage_mesh = mesh.without("pp") if _on_stage_mesh(model, mesh) else None
    if stage_mesh is not None:
        if not all(p.is_meta for p in model.parameters()):
            what = (
                "tensor-parallel" if mesh.axis_size("tp") > 1
                else "context-parallel" if model.strategies.cp > 1
                else "mixture-of-experts"
            )  # fmt: skip
            raise ValueError(f"{what} pipeline stages are laid out from a GPT on the meta device")
        stages = shard_stages(model, stages, stage_mesh, seed=seed)
    elif any(p.is_meta for stage in stages for p in stage.parameters()):
        stages = materialize_stages(model, stages, seed=seed)
    loss_fn = gpt_loss if stage_mesh is None else sharded_gpt_loss(stage_mesh)
    return rank_pipeline(
        stages, split_gpt(model), mesh, schedule=schedule, microbatches=microbatches, virtual=virtual,
        loss_fn=loss_fn, stage_mesh=stage_mesh, bucket_mb=bucket_mb,
    )  # fmt: skip


def _on_stage_mesh(model: GPT, mesh: Mesh) -> bool:
    """Whether the stages are laid out on their stage mesh: with tensor parallelism, and with experts
    whenever several ranks run a stage (their experts cut over ep there, and the balancing losses summed
    over the ranks that hold the micro-batch's other rows, as `MoEMLP` does on DTensors)."""
    ranks = mesh.world_size // mesh.axis_size("pp")
    return mesh.axis_size("tp") > 1 or model.strategies.cp > 1 or (model.config.is_moe and ranks > 1)


def whole_gpt(model: GPT, pipeline: Pipeline, mesh: Mesh, *, schedule: str, virtual: int = 1) -> GPT:
    """The whole `model` unsharded on every rank, with the values `pipeline` trained (to sample from it):
    each parameter taken whole on the pipeline rank that holds it (gathered over its stage mesh; at optimizer
    level 3 from its shards) and broadcast over the pipeline. A collective call on every rank of `mesh`;
    memory for one whole model per rank."""
    pp, here = mesh.axis_size("pp"), mesh.axis_rank("pp")
    owner: dict[str, int] = {}
    every = split_gpt(model)  # the stages `gpt_pipeline` cut: the blocks keep their stage marks
    for pp_rank in range(pp):
        for k in stage_indices(schedule, pp_rank, pp, virtual):
            for name in source_names(model, every[k]):
                owner.setdefault(name, pp_rank)  # a tied table: its first holder's copy
    mine = {
        name: param
        for stage in pipeline.modules
        for name, param in zip(source_names(model, stage), stage.parameters(), strict=True)
    }
    with torch.device("meta"):
        whole = GPT(model.config)
    whole.to_empty(device="cpu")
    whole.init_weights()  # its constant tables; every parameter is overwritten below
    with torch.no_grad(), pipeline.full_parameters():
        for name, param in whole.named_parameters():
            if owner[name] == here:
                param.copy_(full(mine[name]))
            dist.broadcast(param, group=mesh.axis_group("pp"), group_src=owner[name])
    return whole
