"""Pipeline stages of any model with a sequence of blocks, as its `Recipe` (`loom.models.recipes`) describes.

A stage is a contiguous run of the model's blocks, plus the recipe's "before" modules (embeddings) on the
first stage and its "after" modules (final norm, head) on the last. `BlockStage` borrows the model's own
modules (nothing is copied), so a stage trains the very tensors of the model it came from, and its
parameters keep the model's names through `source_names`. Stages exchange only the residual stream
(batch, seq, hidden); whatever else a block takes (position ids, a causal mask, rotary tables) each stage
recomputes from the stream's shape (the recipe's `block_inputs`).

`model_pipeline` builds one rank's part of a pipeline over a mesh's "pp" axis from a whole model (every rank
builds the model, then keeps and runs only its stages), with loom's schedules (`Pipeline`); `whole_model`
gives the trained model back whole on every rank. A parameter that stages on several pipeline ranks share
(a head tied to the embedding table) becomes a `Tied` parameter whose copies take the summed gradient.

A stage is an ordinary module of its model's modules, so a later pass can lay it out on its stage mesh
(`loom.parallelize(stage, mode="semi_auto", ...)`) as the GPT's tensor-parallel stages are.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement

from loom.dist.mesh import Mesh
from loom.layout.redistribute import full
from loom.models.recipes import Recipe, piece, recipe_for, submodule
from loom.parallel.local_region import run_normally
from loom.parallel.pipeline.schedule import SCHEDULES, Pipeline, stage_indices
from loom.parallel.pipeline.stages import balanced_partition
from loom.parallel.pipeline.tensor_stages import lay_out_stages, sharded_loss
from loom.parallel.pipeline.tied import Tied


class BlockStage(nn.Module):
    """Blocks `block_indices` of `model`'s block list (as `recipe` names it), plus the recipe's "before"
    pieces when `first`, its "after" pieces when `last`, and its shared ones (the model's own modules,
    parameters and buffers, under `parts`).

    The first stage takes the model's inputs (token ids), the others the residual stream; the last returns
    what the recipe's loss takes (logits). A stage laid out on a stage mesh (tensor parallelism inside
    stages) has `boundary`, the placements of the residual stream it exchanges as local tensors (torch's
    schedules send plain tensors). `copy_output`: send a copy of the stream (a zero-bubble schedule detaches
    its stages' outputs in place, which a view of the stream does not allow).
    """

    boundary: tuple[Placement, ...] | None = None
    copy_output: bool = False

    def __init__(
        self, model: nn.Module, recipe: Recipe, block_indices: Sequence[int], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.recipe, self.first, self.last = recipe, first, last
        self.block_indices = list(block_indices)
        self.config = getattr(model, "config", None)  # what the recipe's functions read (not a module)
        blocks = submodule(model, recipe.blocks, recipe.family)
        self.blocks = nn.ModuleList(blocks[i] for i in self.block_indices)
        self.parts = nn.Module()
        paths = recipe.shared + (recipe.before if first else ()) + (recipe.after if last else ())
        for path in dict.fromkeys(paths):  # a table tied to the head is in both before and after
            _borrow(self.parts, _key(path), piece(model, path, recipe.family))

    def part(self, path: str) -> Any:
        """The model's module, parameter, buffer or primitive at `path`, which this stage holds."""
        key = _key(path)
        if not hasattr(self.parts, key):
            raise ValueError(
                f"recipe {self.recipe.family!r} reads {path!r} on a stage that does not hold it: list it in "
                f"the recipe's `before` (first stage), `after` (last stage) or `shared` (every stage)"
            )
        return getattr(self.parts, key)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.recipe.embed(self, x)
        inputs = self.recipe.block_inputs(self, x)
        for block in self.blocks:
            x = self.recipe.call_block(block, x, inputs)
        if self.last:
            return self.recipe.finish(self, x)
        if self.boundary is not None:  # this rank's piece of the stream, as a plain tensor
            x = x.redistribute(x.device_mesh, self.boundary).to_local()
        if self.copy_output and (self.boundary is not None or x._base is not None):
            x = x.clone()
        return x


def _key(path: str) -> str:
    """A path as an attribute name of `BlockStage.parts` (which cannot hold dots)."""
    return path.replace(".", "_")


def _borrow(parts: nn.Module, key: str, borrowed: object) -> None:
    """Register the model's own module, parameter or buffer in `parts` (the very object: nothing is
    copied; a buffer stays out of the stage's state, as the model's constant tables are); anything else
    (a loom primitive) is a plain attribute."""
    if isinstance(borrowed, nn.Module):
        parts.add_module(key, borrowed)
    elif isinstance(borrowed, nn.Parameter):
        parts.register_parameter(key, borrowed)
    elif isinstance(borrowed, torch.Tensor):
        parts.register_buffer(key, borrowed, persistent=False)
    else:
        setattr(parts, key, borrowed)


def block_split(blocks: int, stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """The block indices of each of `stages` stages: `split` gives each stage's block count (uneven splits
    allowed, e.g. [3, 4, 4, 3]); by default the blocks are cut evenly (the blocks of a model are alike)."""
    if split is None:
        if stages > blocks:
            raise ValueError(
                f"{stages} pipeline stages for {blocks} blocks: every stage needs a block; lower pp (or "
                f"virtual stages) or add layers"
            )
        marks = balanced_partition([1.0] * blocks, stages)
        split = [marks.count(k) for k in range(stages)]
    split = list(split)
    if len(split) != stages or any(not isinstance(n, int) or n < 1 for n in split) or sum(split) != blocks:
        raise ValueError(
            f"split {split}: give {stages} block counts (one per stage: pp x virtual), each at least 1, "
            f"summing to the model's {blocks} blocks"
        )
    starts = [sum(split[:k]) for k in range(stages)]
    return [list(range(start, start + n)) for start, n in zip(starts, split, strict=True)]


def blocks_per_stage(paths: Sequence[Sequence[str]], recipe: Recipe) -> list[int]:
    """Blocks per stage from each stage's module paths (`[["model.embed_tokens", "model.layers.0", ...],
    ...]`): each stage names consecutive blocks of the recipe's block list (`"<blocks>.<index>"`), the
    stages in block order; the recipe's "before" pieces may be named on the first stage and its "after"
    pieces on the last (where the recipe puts them anyway)."""
    counts, seen, last = [], [], len(paths) - 1
    for k, stage in enumerate(paths):
        if isinstance(stage, str) or not isinstance(stage, Sequence):
            raise ValueError(
                f"stage {k} is {stage!r}: give each stage a list of module paths (or every stage a count)"
            )
        allowed = set(recipe.before if k == 0 else ()) | set(recipe.after if k == last else ())
        indices = []
        for path in stage:
            head, _, index = path.rpartition(".")
            if head == recipe.blocks and index.isdigit():
                indices.append(int(index))
            elif path not in allowed:
                raise ValueError(
                    f"stage {k} names {path!r}, which is neither a block of {recipe.blocks!r} (as "
                    f"'{recipe.blocks}.<index>') nor a piece recipe {recipe.family!r} puts on that stage "
                    f"(before the blocks: {list(recipe.before)} on the first; after: {list(recipe.after)} on "
                    f"the last)"
                )
        counts.append(len(indices))
        seen.extend(indices)
    if seen != list(range(len(seen))):
        raise ValueError(
            f"stages name blocks {seen}: a pipeline runs consecutive blocks in order, each once (0, 1, 2, ...)"
        )
    return counts


def split_model(
    model: nn.Module,
    stages: int,
    *,
    recipe: Recipe | None = None,
    blocks: str | None = None,
    split: Sequence[int] | Sequence[Sequence[str]] | None = None,
) -> list[BlockStage]:
    """All `stages` stages of `model`, blocks cut by `split`: blocks per stage (see `block_split`), or each
    stage's module paths (see `blocks_per_stage`), as a Plan's `stages` gives them. `recipe`: where the
    model's pieces are (default: `recipe_for(model, blocks)`, its class's, `blocks` naming the path of its
    block list). Every parameter of the model must sit in a stage."""
    recipe = recipe or recipe_for(model, blocks)
    if recipe.check is not None:
        recipe.check(model)
    if split is not None and any(not isinstance(n, int) for n in split):
        split = blocks_per_stage(split, recipe)
    groups = block_split(len(submodule(model, recipe.blocks, recipe.family)), stages, split)
    last = len(groups) - 1
    every = [BlockStage(model, recipe, g, first=k == 0, last=k == last) for k, g in enumerate(groups)]
    held = {p for stage in every for p in stage.parameters()}
    missing = [name for name, p in model.named_parameters() if p not in held]
    if missing:
        raise ValueError(
            f"{type(model).__name__}: parameters {missing[:4]}{' ...' if len(missing) > 4 else ''} are in no "
            f"pipeline stage of recipe {recipe.family!r}: name their modules in the recipe's `before` (first "
            f"stage) or `after` (last stage)"
        )
    return every


def model_pipeline(
    model: nn.Module,
    mesh: Mesh,
    *,
    schedule: str,
    microbatches: int,
    virtual: int = 1,
    recipe: Recipe | None = None,
    blocks: str | None = None,
    split: Sequence[int] | Sequence[Sequence[str]] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    bucket_mb: float = 25.0,
    module_plan: Mapping[str, Any] | None = None,
    ep: int = 1,
) -> Pipeline:
    """This rank's part of `model` as a pipeline over `mesh`'s "pp" axis: `pp x virtual` stages of its
    `recipe` (or the one `recipe_for(model, blocks)` gives) cut by `split` (see `split_model`), this rank's
    placed as `schedule` places them, their gradients averaged over the "dp" axis in buckets of about
    `bucket_mb` megabytes. `loss_fn(output, targets)` on the last stage defaults to the recipe's loss (a
    Hugging Face causal LM: its shifted cross-entropy, targets = labels).

    Every rank builds the whole model; the parameters of the stages other ranks run are then moved to the
    meta device (no memory here): `model` is not runnable whole afterwards (`whole_model` gives it back).
    Without a "tp" axis the stages compute on this process alone: run them with no current mesh
    (`loom.dist.context.unsharded`, as the `Trainer` does for a pipeline). With one, each stage is laid out on its
    stage mesh (the dp x tp ranks of its pipeline index) by `module_plan` (default: the recipe's
    `tensor_plan`; patterns over the whole model's paths): see `loom.parallel.pipeline.tensor_stages`.
    With `ep > 1` each stage is laid out on its stage mesh too, its experts (the family's `ExpertsRecipe`,
    Mixtral's) cut over the innermost `ep` ranks of the stage's dp, as `Plan(ep=...)` cuts them without
    pipelines (`loom.parallel.experts.expert_module_plan`)."""
    pp = mesh.axis_size("pp")
    if pp == 1:
        raise ValueError(f"a pipeline needs a mesh with a 'pp' axis of size > 1, got {mesh}")
    if mesh.axis_size("cp") > 1:
        raise ValueError(
            f"model_pipeline: the mesh {mesh} cuts the sequence over cp, which pipeline stages do for loom's GPT "
            f"only (gpt_pipeline); run {type(model).__name__} with cp = 1 in a pipeline, or cut its sequences "
            f"without one (loom.parallelize(model, plan=Plan(cp=...)))"
        )
    recipe = recipe or recipe_for(model, blocks)
    every = split_model(model, pp * virtual, recipe=recipe, split=split)
    stages = [every[k] for k in stage_indices(schedule, mesh.axis_rank("pp"), pp, virtual)]
    loss_fn = loss_fn or recipe.loss
    tp = mesh.axis_size("tp")
    stage_mesh = mesh.without("pp") if tp > 1 or ep > 1 else None
    if stage_mesh is not None:
        _refuse_tied_copies(model, every)
        plan = _tensor_plan(model, recipe, module_plan) if tp > 1 else dict(module_plan or {})
        lay_out_stages(model, stages, stage_mesh, plan, ep=ep)
        loss_fn = sharded_loss(loss_fn, stage_mesh)
    pipeline = rank_pipeline(
        stages, every, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual,
        loss_fn=loss_fn, stage_mesh=stage_mesh, bucket_mb=bucket_mb,
    )  # fmt: skip
    mine = {p for stage in stages for p in stage.parameters()}
    _replace_parameters(model, lambda p: p if p in mine else torch.empty_like(p, device="meta"))
    return pipeline


def _refuse_tied_copies(model: nn.Module, every: Sequence[BlockStage]) -> None:
    """Tensor-parallel stages of any model do not yet keep a parameter that several stages hold (a head tied
    to the token table: on two pipeline ranks, or on one with a V placement) one tensor: refuse it rather
    than train two drifting copies."""
    holders: dict[int, int] = {}
    for stage in every:
        for param in stage.parameters():
            holders[id(param)] = holders.get(id(param), 0) + 1
    names = {id(p): n for n, p in model.named_parameters()}
    shared = [names[i] for i, count in holders.items() if count > 1]
    if shared:
        raise ValueError(
            f"{type(model).__name__}: {shared[0]} is tied between pipeline stages (a head tied to the token "
            f"table), which tensor-parallel stages of this model do not support yet: untie it "
            f"(config.tie_word_embeddings = False), or use tp = 1 with pipelines"
        )


def _tensor_plan(
    model: nn.Module, recipe: Recipe, module_plan: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    if module_plan is not None:
        return module_plan
    if not recipe.tensor_plan:
        raise ValueError(
            f"a 'tp' axis lays out each pipeline stage by a module plan, and recipe {recipe.family!r} of "
            f"{type(model).__name__} has no tensor_plan: pass module_plan={{pattern: strategy}} (see "
            f"docs/any_model.md)"
        )
    return recipe.tensor_plan


def _replace_parameters(model: nn.Module, make: Callable[[nn.Parameter], torch.Tensor]) -> None:
    """Put `make(param)` in place of each parameter of `model` that it does not return itself, as a
    parameter under every name it has (a tied table keeps one tensor)."""
    made: dict[nn.Parameter, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param not in made:
            new = make(param)
            made[param] = new if new is param else nn.Parameter(new, param.requires_grad)
        if made[param] is not param:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, made[param])


def rank_pipeline(
    stages: Sequence[BlockStage],
    every: Sequence[BlockStage],
    mesh: Mesh,
    *,
    schedule: str,
    microbatches: int,
    virtual: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stage_mesh: Mesh | None = None,
    bucket_mb: float = 25.0,
) -> Pipeline:
    """The `Pipeline` of this rank's `stages` on `mesh`: its pipeline group on "pp", the stages' replicas on
    "dp", the copies of parameters shared by stages on several ranks (found in `every`, all the model's
    stages) tied. `stage_mesh`: the mesh the stages are laid out on, if any (tensor parallelism inside
    stages)."""
    for stage in stages:
        stage.copy_output = SCHEDULES[schedule].split_backward
    return Pipeline(
        stages,
        schedule=schedule,
        microbatches=microbatches,
        loss_fn=loss_fn,
        group=mesh.axis_group("pp"),
        dp_group=mesh.axis_group("dp"),
        stage_group=mesh.group({axis: None for axis in mesh.shape.names if axis != "pp"}),
        tied=tied_parameters(every, schedule, mesh, virtual),
        mesh=stage_mesh,
        bucket_mb=bucket_mb,
    )


def tied_parameters(stages: Sequence[nn.Module], schedule: str, mesh: Mesh, virtual: int = 1) -> list[Tied]:
    """A `Tied` for each parameter that stages on several pipeline ranks share (a head tied to the
    embedding table), in the model's order: its copies are reduced on the group of those pipeline ranks'
    data-parallel replicas. Shared by stages of one rank only (a V placement puts the first and the last
    stage on rank 0), a parameter is one tensor there and needs none. A collective call on every rank."""
    pp = mesh.axis_size("pp")
    rank_of = {k: r for r in range(pp) for k in stage_indices(schedule, r, pp, virtual)}
    holders: dict[nn.Parameter, set[int]] = {}
    for k, stage in enumerate(stages):
        for param in stage.parameters():
            holders.setdefault(param, set()).add(rank_of[k])
    here = mesh.axis_rank("pp")
    tied = []
    for param, ranks in holders.items():
        if len(ranks) < 2:
            continue
        # its gradient is pending over the stage's batch axes (dp, and cp's pieces of the sequences)
        vary = {"pp": tuple(sorted(ranks))} | {
            axis: None for axis in ("dp", "cp") if axis in mesh.shape.names
        }
        group = mesh.group(vary)
        tied.append(Tied(param=param if here in ranks else None, holders=len(ranks), group=group))
    return tied


def source_names(model: nn.Module, stage: nn.Module) -> list[str]:
    """The model's name of each of `stage`'s parameters (in `stage.parameters()` order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in stage.parameters()]


class StageParameters(nn.Module):
    """This rank's part of the whole model's parameters under the model's names (see `stage_parameters`).
    `full_parameters()` has them whole in memory inside the block (at optimizer level 3 they are sharded at
    rest), as a parallelised model's `model.loom.full_parameters()` does: checkpoints read them there."""

    def __init__(self, full_parameters: Callable[[], AbstractContextManager] | None = None) -> None:
        super().__init__()
        self._full_parameters = full_parameters

    def full_parameters(self) -> AbstractContextManager:
        return self._full_parameters() if self._full_parameters is not None else contextlib.nullcontext()


def stage_parameters(
    model: nn.Module,
    stages: Sequence[nn.Module],
    full_parameters: Callable[[], AbstractContextManager] | None = None,
) -> StageParameters:
    """A module that holds the parameters of `stages` (the very tensors) under the model's names, empty
    modules in between: its `state_dict` is this rank's part of the whole model's, which is what a
    checkpoint saves, so that it loads on any other split of the model. `full_parameters`: the pipeline's
    (`Pipeline.full_parameters`), where its parameters are sharded at rest."""
    root = StageParameters(full_parameters)
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


def whole_model(
    model: nn.Module,
    pipeline: Pipeline,
    mesh: Mesh,
    *,
    recipe: Recipe | None = None,
    blocks: str | None = None,
    split: Sequence[int] | Sequence[Sequence[str]] | None = None,
) -> nn.Module:
    """A copy of `model` whole on every rank with the values `pipeline` trained (to sample from it or save
    it): `pipeline` built by `model_pipeline` with the same `recipe`, `blocks` and `split`; each parameter
    taken on the first pipeline rank that holds it (at optimizer level 3 gathered from its shards; with
    tensor parallelism gathered over its stage mesh) and broadcast over the pipeline. A collective call on every rank of `mesh`; memory for one more whole
    model per rank."""
    pp, virtual = mesh.axis_size("pp"), len(pipeline.modules)
    every = split_model(model, pp * virtual, recipe=recipe, blocks=blocks, split=split)
    owner: dict[str, int] = {}
    for pp_rank in range(pp):
        for k in stage_indices(pipeline.schedule_name, pp_rank, pp, virtual):
            for name in source_names(model, every[k]):
                owner.setdefault(name, pp_rank)  # a tied table: its first holder's copy
    with torch.no_grad(), pipeline.full_parameters():
        whole = copy.deepcopy(model)  # this rank's stages whole inside the block, the others' on meta
    run_normally(whole)  # a local region's wrapper would call the original module, not its copy
    device = next(iter(pipeline.parameters())).device
    _replace_parameters(
        whole, lambda p: torch.empty_like(p, device=device) if p.is_meta else full(p.detach())
    )
    with torch.no_grad():
        for name, param in whole.named_parameters():
            dist.broadcast(param, group=mesh.axis_group("pp"), group_src=owner[name])
    return whole
