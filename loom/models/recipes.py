"""Per-model-family recipes as data: where a model keeps its blocks, embeddings and head, and how a block is
called, so that the parallel layer (pipeline stages, optimizer level 3) works on any model without a branch
per family.

A `Recipe` names paths of the model's modules, parameters, buffers or other callables (loom's primitives),
dotted as `model.get_submodule` takes them, and four small functions: `embed` (what the first pipeline stage
does before the blocks), `block_inputs` (the keyword arguments every block takes besides the residual
stream), `call_block` and `finish` (what the last stage does after the blocks). Every function reads the model's pieces through the stage
(`stage.part(path)`) and the model's config (`stage.config`), never through the whole model, so that a stage
holds only its own pieces.

Hugging Face decoder blocks take position ids, a causal mask and, with rotary positions, the `(cos, sin)`
tables that `model.model.rotary_emb` computes. Without a padding mask these are functions of the sequence
length alone, so each stage recomputes them from the residual stream it receives: stages exchange only the
stream (batch, seq, hidden). Training with a padding mask is not supported by these recipes. Labels of -100
are ignored by the loss, but a pipeline averages its micro-batches' means, which equals one device's mean
over the batch's tokens only when every micro-batch holds as many labelled tokens.

Each Hugging Face recipe also carries Megatron's tensor-parallel layouts as a module plan (`tensor_plan`),
and a family with a mixture of experts says how its experts module holds and takes its experts
(`ExpertsRecipe`), so that `loom.parallelize` can cut them over expert-parallel ranks without a branch per
family.

`RECIPES` maps a model's class name to its recipe, or to a function of the model that makes it where the
layout depends on the model's config (loom's GPT: learned or rotary positions, a tied head);
`recipe_for(model)` finds it. Other models pass their own `Recipe`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from loom.models.moe import MoEConfig

BLOCK_PATHS = ("model.layers", "layers", "transformer.h", "blocks")
"""Where models usually keep their block list, tried in this order when no path is given."""


class Stage(Protocol):
    """What a recipe's functions see of a pipeline stage: its modules by the model's paths, and the config."""

    config: Any

    def part(self, path: str) -> Any: ...


StageFn = Callable[[Stage, torch.Tensor], torch.Tensor]
BlockInputs = Callable[[Stage, torch.Tensor], dict[str, Any]]
CallBlock = Callable[[nn.Module, torch.Tensor, Mapping[str, Any]], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def run_in_order(paths: tuple[str, ...]) -> StageFn:
    """A function of a stage and a tensor that runs the modules at `paths` one after the other (a plain
    embedding table; a final norm and a head)."""

    def run(stage: Stage, x: torch.Tensor) -> torch.Tensor:
        for path in paths:
            x = stage.part(path)(x)
        return x

    return run


def no_block_inputs(stage: Stage, x: torch.Tensor) -> dict[str, Any]:
    """Blocks that take the residual stream alone."""
    return {}


def call_with_keywords(block: nn.Module, x: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """`block(x, **inputs)`; a block that returns a tuple (older Hugging Face layers) gives its first item."""
    out = block(x, **inputs)
    return out[0] if isinstance(out, tuple) else out


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of logits (batch, seq, vocab) against targets already shifted (batch, seq)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss (`ForCausalLMLoss`): logits at position t predict `labels[t + 1]`,
    labels of -100 are ignored, the mean over the remaining tokens. When no label is -100 every micro-batch
    holds as many tokens, so the mean of the micro-batches' means is the whole batch's mean."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class ExpertsRecipe:
    """How a family's experts module holds its experts, for expert parallelism (`loom.parallel.experts`).

    `modules`: the module path pattern of the experts modules (one per block). `stacked`: the names of their
    parameters stacked by expert on dim 0 (three dims each), the ones cut over the ep ranks. `config(module)`:
    the experts' shape as a `MoEConfig` (hidden, ffn_hidden, experts, top_k, activation), or a ValueError for
    one loom's expert MLP cannot compute. `weights(module, stacked)`: the stacked weights (by name, this
    rank's experts) as `loom.models.moe.expert_mlp` takes them, `[experts, in, out]` in its order (views: the
    gradients flow back to the module's own tensors). `inputs(*args, **kwargs)`: the module's forward
    arguments as (token rows `[tokens, hidden]`, chosen experts `[tokens, top_k]`, their weights
    `[tokens, top_k]`); the forward returns the weighted sum of the chosen experts' outputs per token.
    """

    modules: str
    stacked: tuple[str, ...]
    config: Callable[[nn.Module], MoEConfig]
    weights: Callable[[nn.Module, Mapping[str, Tensor]], list[Tensor]]
    inputs: Callable[..., tuple[Tensor, Tensor, Tensor]]

    def module_plan(self) -> dict[str, Any]:
        """The module plan entry cutting every experts module's stacked weights on their expert dim over
        the plan's "ep" ranks (the innermost ones of "dp"), whole along every other axis."""
        cut = ("ep", "None", "None")
        return {self.modules: {"parameter_plan": {name: cut for name in self.stacked}}}


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Where a model family keeps its pieces, as paths in the whole model, and how a stage runs them.

    `blocks`: the block list (an `nn.ModuleList` or `nn.Sequential`); a pipeline stage is a contiguous run
    of its blocks. `before`: what the first stage uses before the blocks (embeddings); `after`: what the
    last stage uses after them (final norm, head; a table tied to the embedding is in both); `shared`:
    parameter-free pieces every stage uses (rotary tables, a causal mask). Paths name modules, parameters or
    buffers. `embed(stage, inputs)` makes the first stage's residual stream (default: the `before` modules
    in order); `block_inputs(stage, x)` the keyword arguments of every block, from the stream's shape;
    `call_block(block, x, inputs)` runs one block; `finish(stage, x)` makes the last stage's output
    (default: the `after` modules in order). `loss(output, targets)` is the family's training loss, on the
    last stage; `check(model)` raises a `ValueError` for a model the recipe cannot run as configured.
    `classes`: the model class names `RECIPES` files the recipe under. `tensor_plan`: the module plan of
    Megatron's tensor-parallel layouts (`loom.parallelize(model, module_plan=recipe.tensor_plan)`).
    `experts`: how the family's mixture of experts holds its experts (None: it has none), for `Plan(ep=...)`.
    `attention`: the module-path pattern of its attention modules, those that call transformers' attention
    interface (None: loom cannot cut its sequences), for `Plan(cp=...)` (`loom.parallel.hf_context`).
    """

    family: str
    blocks: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    embed: StageFn | None = None
    block_inputs: BlockInputs = no_block_inputs
    call_block: CallBlock = call_with_keywords
    finish: StageFn | None = None
    loss: LossFn = token_cross_entropy
    check: Callable[[nn.Module], None] | None = None
    classes: tuple[str, ...] = ()
    tensor_plan: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    experts: ExpertsRecipe | None = None
    attention: str | None = None

    def __post_init__(self) -> None:
        for group in (self.before, self.after, self.shared):
            if len(set(group)) != len(group) or self.blocks in group:
                raise ValueError(
                    f"recipe {self.family!r}: a path appears twice in {group} (blocks {self.blocks!r})"
                )
        if set(self.shared) & set(self.before + self.after):
            raise ValueError(
                f"recipe {self.family!r}: a path is both shared and before/after; list it once, in `shared` "
                f"(every stage holds those)"
            )
        if self.embed is None:
            object.__setattr__(self, "embed", run_in_order(self.before))
        if self.finish is None:
            object.__setattr__(self, "finish", run_in_order(self.after))

    def parts(self, model: nn.Module) -> dict[str, Any]:
        """Every piece the recipe names besides the blocks, by path, checked to exist in `model`."""
        return {path: piece(model, path, self.family) for path in (*self.before, *self.after, *self.shared)}


def submodule(model: nn.Module, path: str, family: str) -> nn.Module:
    """`model.get_submodule(path)`, or a `ValueError` that names the model, the path and the recipe."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"{type(model).__name__} has no module {path!r}, which recipe {family!r} names: pass a Recipe "
            f"whose paths match the model (see loom.models.recipes)"
        ) from None


def piece(model: nn.Module, path: str, family: str) -> Any:
    """The module, parameter, buffer or other callable (a loom primitive) at `path` of `model`, or a
    `ValueError` as `submodule` gives."""
    owner, _, leaf = path.rpartition(".")
    parent = submodule(model, owner, family) if owner else model
    if leaf in parent._parameters or leaf in parent._buffers or leaf in parent._modules:
        return getattr(parent, leaf)
    if callable(getattr(parent, leaf, None)) and not hasattr(type(parent), leaf):  # not a method
        return getattr(parent, leaf)
    return submodule(model, path, family)


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, nn.Module]:
    """The model's block list and its path: `path` when given, else the first of `BLOCK_PATHS` that is a
    list of modules."""
    if path is not None:
        blocks = submodule(model, path, "given")
        if not isinstance(blocks, nn.ModuleList | nn.Sequential):
            raise ValueError(f"{type(model).__name__}.{path} is a {type(blocks).__name__}, not a block list")
        return path, blocks
    for candidate in BLOCK_PATHS:
        try:
            blocks = model.get_submodule(candidate)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList | nn.Sequential):
            return candidate, blocks
    raise ValueError(
        f"{type(model).__name__} has no block list at any of {list(BLOCK_PATHS)}: pass the path of its block "
        f"list (e.g. blocks='encoder.layers') or a Recipe (loom.models.recipes.Recipe)"
    )


# Megatron's tensor-parallel layouts, as module plans for `loom.parallelize(..., module_plan=...)` (see
# docs/any_model.md): attention's query/key/value and the MLP's first matrices cut by output features along
# the mesh's "tp" axis (column parallel), the attention output and the MLP's last matrix by input features
# (row parallel), the embedding by vocabulary rows and the head by vocabulary. On a mesh without "tp" every
# entry means "not cut". `nn.Linear` stores weights as (out, in); GPT-2's `Conv1D` as (in, out).

# Rows of the batch along "dp"; a row-parallel output summed right away (Megatron's one all-reduce per
# row-parallel matrix), so that the residual stream stays whole along "tp" rather than a pending sum that
# every later operator would have to reduce.
WHOLE = (("dp", "None", "None"),)
COLUMN = {"parameter_plan": {"weight": ("tp", "None")}}
ROW = {"parameter_plan": {"weight": ("None", "tp")}, "out_strategy": WHOLE}
# The embedding's partial rows are summed once, right away (Megatron's all-reduce after a vocab-parallel
# embedding): its output is the batch cut along "dp", whole along "tp".
VOCAB_ROWS = {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE}

LLAMA_TENSOR_PLAN = {
    "*.embed_tokens": VOCAB_ROWS,
    "*.self_attn.q_proj": COLUMN,
    "*.self_attn.k_proj": COLUMN,
    "*.self_attn.v_proj": COLUMN,
    "*.self_attn.o_proj": ROW,
    "*.mlp.gate_proj": COLUMN,
    "*.mlp.up_proj": COLUMN,
    "*.mlp.down_proj": ROW,
    "lm_head": COLUMN,
}

# GPT-2's attention projects query, key and value with one fused matrix and splits its output in three,
# so a column cut of it is gathered at the split (DTensor's rule); its MLP and projections are Megatron's.
GPT2_TENSOR_PLAN = {
    "*.wte": VOCAB_ROWS,
    "*.attn.c_attn": {"parameter_plan": {"weight": ("None", "tp"), "bias": ("tp",)}},
    "*.attn.c_proj": {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE},
    "*.mlp.c_fc": {"parameter_plan": {"weight": ("None", "tp"), "bias": ("tp",)}},
    "*.mlp.c_proj": {"parameter_plan": {"weight": ("tp", "None")}, "out_strategy": WHOLE},
    "lm_head": COLUMN,  # tied to wte: the same layout, also where a pipeline puts them on different stages
}

# Mixtral: attention as Llama's; the router and the experts stay replicated and run on each rank's own
# tokens (a local region: their routing has data-dependent shapes; an automatic plan may keep the experts'
# weights cut, which the region gathers). With `Plan(ep=...)` `loom.parallelize`
# replaces the experts' entry by the recipe's expert-parallel one (`ExpertsRecipe.module_plan`).
MIXTRAL_TENSOR_PLAN = {
    "*.embed_tokens": VOCAB_ROWS,
    "*.self_attn.q_proj": COLUMN,
    "*.self_attn.k_proj": COLUMN,
    "*.self_attn.v_proj": COLUMN,
    "*.self_attn.o_proj": ROW,
    "*.mlp.experts": {"local": True},
    "lm_head": COLUMN,
}


# Hugging Face decoders: positions, masks and rotary tables recomputed on every stage from the stream's shape.


def _positions(x: torch.Tensor) -> torch.Tensor:
    """Position ids (1, seq) of a batch without a cache: 0 .. seq-1."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _causal_mask(config: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The mask the model itself builds without a padding mask (None where the attention kernel applies
    causality itself), sliding-window where the config asks for one."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    sliding = getattr(config, "sliding_window", None) is not None
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(
        config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=positions
    )


def _gpt2_embed(stage: Stage, ids: torch.Tensor) -> torch.Tensor:
    x = stage.part("transformer.wte")(ids) + stage.part("transformer.wpe")(_positions(ids))
    return stage.part("transformer.drop")(x)


def _gpt2_block_inputs(stage: Stage, x: torch.Tensor) -> dict[str, Any]:
    positions = _positions(x)
    return {"attention_mask": _causal_mask(stage.config, x, positions), "position_ids": positions}


def _rotary_block_inputs(stage: Stage, x: torch.Tensor) -> dict[str, Any]:
    positions = _positions(x)
    return {
        "attention_mask": _causal_mask(stage.config, x, positions),
        "position_ids": positions,
        "position_embeddings": stage.part("model.rotary_emb")(x, positions),
    }


GPT2 = Recipe(
    family="gpt2",
    classes=("GPT2LMHeadModel",),
    blocks="transformer.h",
    before=("transformer.wte", "transformer.wpe", "transformer.drop"),
    after=("transformer.ln_f", "lm_head"),
    embed=_gpt2_embed,
    block_inputs=_gpt2_block_inputs,
    loss=causal_lm_loss,
    tensor_plan=GPT2_TENSOR_PLAN,
    attention="*.attn",
)

LLAMA = Recipe(
    family="llama",
    classes=("LlamaForCausalLM",),
    blocks="model.layers",
    before=("model.embed_tokens",),
    after=("model.norm", "lm_head"),
    shared=("model.rotary_emb",),
    block_inputs=_rotary_block_inputs,
    loss=causal_lm_loss,
    tensor_plan=LLAMA_TENSOR_PLAN,
    attention="*.self_attn",
)


def _no_router_loss(model: nn.Module) -> None:
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} with output_router_logits=True adds the router's auxiliary loss, which "
            f"pipeline stages do not compute: set config.output_router_logits = False"
        )


def _mixtral_experts_config(experts: nn.Module) -> MoEConfig:
    """A `MixtralExperts` module's shape: SwiGLU experts (`act_fn(gate) * up`, then down)."""
    config = experts.config
    if config.hidden_act != "silu":
        raise ValueError(
            f"expert parallelism computes Mixtral's experts as SwiGLU (silu), but hidden_act = "
            f"{config.hidden_act!r}; set ep = 1 for this model"
        )
    return MoEConfig(
        hidden=experts.hidden_dim, ffn_hidden=experts.intermediate_dim, experts=experts.num_experts,
        top_k=config.num_experts_per_tok, activation="swiglu",
        # the model's own router weighs the experts; a top-1 config must not ask for renormalised weights
        normalize_weights=config.num_experts_per_tok > 1,
    )  # fmt: skip


def _mixtral_expert_weights(experts: nn.Module, stacked: Mapping[str, Tensor]) -> list[Tensor]:
    """`gate_up_proj` `[E, 2I, H]` (the gate's rows first) and `down_proj` `[E, H, I]`, stored as
    `nn.Linear` weights (out, in), as (gate, up, down) `[E, in, out]`."""
    gate, up = stacked["gate_up_proj"].chunk(2, dim=1)
    return [gate.transpose(1, 2), up.transpose(1, 2), stacked["down_proj"].transpose(1, 2)]


def _mixtral_expert_inputs(
    hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`MixtralExperts.forward`'s arguments, by their names."""
    return hidden_states, top_k_index, top_k_weights


MIXTRAL_EXPERTS = ExpertsRecipe(
    modules="*.mlp.experts",
    stacked=("gate_up_proj", "down_proj"),
    config=_mixtral_experts_config,
    weights=_mixtral_expert_weights,
    inputs=_mixtral_expert_inputs,
)

MIXTRAL = dataclasses.replace(
    LLAMA,
    family="mixtral",
    classes=("MixtralForCausalLM",),
    check=_no_router_loss,
    tensor_plan=MIXTRAL_TENSOR_PLAN,
    experts=MIXTRAL_EXPERTS,
)


PositionsFn = Callable[[torch.Tensor], torch.Tensor]
"""The global position of every token of a (batch, seq / cp, ...) piece of the sequences."""


def _gpt_embed(stage: Stage, ids: torch.Tensor, positions: PositionsFn | None = None) -> torch.Tensor:
    x = stage.part("lookup")(stage.part("embedding"), ids)
    if stage.config.positions == "rotary":
        return stage.part("enter")(x)
    if positions is not None:  # context parallelism: each token's row of the table, by global position
        return stage.part("add_positions")(
            x, stage.part("position_rows")(stage.part("positions"), positions(ids))
        )
    return stage.part("add_positions")(x, stage.part("positions")[: ids.shape[1]])


def _gpt_block_inputs(stage: Stage, x: torch.Tensor, positions: PositionsFn | None = None) -> dict[str, Any]:
    seq = x.shape[1]
    rotary = stage.config.positions == "rotary"
    if rotary and positions is not None:  # context parallelism: per row, (batch, 1, seq / cp, head_dim)
        rows = positions(x)
        rope = tuple(
            stage.part("position_rows")(stage.part(t), rows).unsqueeze(1) for t in ("rope_cos", "rope_sin")
        )
    else:
        rope = (stage.part("rope_cos")[:seq], stage.part("rope_sin")[:seq]) if rotary else None
    return {"mask": stage.part("causal_mask")[:seq, :seq], "rope": rope}


def _gpt_finish(stage: Stage, x: torch.Tensor) -> torch.Tensor:
    head = stage.part("embedding" if stage.config.tie_embeddings else "head")
    return stage.part("logits")(
        stage.part("norm")(x), head
    )  # on a stage mesh a DTensor, as the loss takes it


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from loom.models.gpt import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets)


def gpt_recipe(model: nn.Module) -> Recipe:
    """loom's GPT (`loom.models.gpt.GPT`): the token table and its lookup (and the learned positions, or
    the identity that lays out the stream for rotary ones) before the blocks; the final norm and the logits
    against the head (the token table itself when tied) after them; the causal mask and rotary tables on
    every stage. Targets are shifted already. With context parallelism (`Strategies.cp > 1`) each stage
    takes this rank's piece of the sequences and looks its positions up by each token's global position
    (`loom.models.gpt.token_positions`), as the whole GPT does."""
    from loom.models.gpt import token_positions

    config, s = model.config, model.strategies
    learned = config.positions == "learned"
    tables = ("causal_mask",) + (() if learned else ("rope_cos", "rope_sin"))
    positions = None
    if s.cp > 1:
        tables += ("position_rows",)
        positions = functools.partial(token_positions, s=s, mesh=model.mesh, max_seq_len=config.max_seq_len)
    return Recipe(
        family="gpt",
        blocks="blocks",
        before=("embedding", "lookup") + (("positions", "add_positions") if learned else ("enter",)),
        after=("norm", "logits", "embedding" if config.tie_embeddings else "head"),
        shared=tables,
        embed=functools.partial(_gpt_embed, positions=positions),
        block_inputs=functools.partial(_gpt_block_inputs, positions=positions),
        finish=_gpt_finish,
        loss=_gpt_loss,
    )


RECIPES: dict[str, Recipe | Callable[[nn.Module], Recipe]] = {
    **{name: recipe for recipe in (GPT2, LLAMA, MIXTRAL) for name in recipe.classes},
    "GPT": gpt_recipe,
}
"""Recipes by the model's class name: a recipe, or a function of the model that makes it."""


def known_recipe(model: nn.Module) -> Recipe | None:
    """The recipe of `model`'s class, None when loom has none."""
    entry = RECIPES.get(type(model).__name__)
    return entry if entry is None or isinstance(entry, Recipe) else entry(model)


def recipe_for(model: nn.Module, blocks: str | None = None) -> Recipe:
    """The recipe of `model`'s class (with `blocks`, its block list at that path). A class loom has no
    recipe for gets a plain one when it has a block list (at `blocks`, or found at one of `BLOCK_PATHS`):
    blocks that take the stream alone, nothing before or after them."""
    recipe = known_recipe(model)
    if recipe is not None:
        return recipe if blocks is None else dataclasses.replace(recipe, blocks=blocks)
    try:
        path, _ = find_blocks(model, blocks)
    except ValueError as error:
        raise ValueError(
            f"{error}. loom has no recipe for {type(model).__name__} (known: {sorted(RECIPES)}): pass "
            f"recipe=Recipe(family=..., blocks='path.to.blocks', before=(embedding paths...), after=(final "
            f"norm, head paths...)) from loom.models.recipes"
        ) from None
    return Recipe(family=type(model).__name__, blocks=path)


def tensor_plan(model: nn.Module) -> Mapping[str, Any]:
    """The Megatron module plan of `model`'s family, or a clear error."""
    recipe = known_recipe(model)
    if recipe is None or not recipe.tensor_plan:
        raise ValueError(
            f"no tensor-parallel plan is known for {type(model).__name__}; known: "
            f"{sorted(name for name, r in RECIPES.items() if isinstance(r, Recipe) and r.tensor_plan)}. "
            f"Give its modules strategies yourself: parallelize(model, module_plan={{'*.q_proj': "
            f"{{'parameter_plan': {{'weight': ('tp', 'None')}}}}, ...}})"
        )
    return recipe.tensor_plan
