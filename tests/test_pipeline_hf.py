"""Tier 2: Hugging Face GPT-2, Llama and Mixtral (built offline from a config, unedited, fp32, sdpa
attention) cut into pipeline stages by their recipes train like one device: 3 Lipschitz AdamW steps
(tests/equivalence.py) give the one-device losses, gradient norms, gradients and evaluation loss (rtol
`RTOL`) and parameters (`param_atol`; also the whole model gathered on every rank by `whole_model`), at
pp=2 (even and uneven splits; 1F1B, GPipe, interleaved, ZBV) and dp=2 x pp=2. Optimizer level 3
(parameters sharded at rest) for Llama and GPT-2 (tied head) at dp=2 x pp=2 and at dp=2 without a
pipeline. The loss is the model's own causal LM loss, on the last stage.
Tier 1: stages composed in one process give the model's logits exactly (sdpa and eager attention, and
loom's GPT through its recipe); bad recipes and splits are clear errors."""

import functools
from copy import deepcopy

import hf_models
import pytest
import torch
from equivalence import ADAMW, GRAD_ATOL, RTOL, adamw, assert_params_close

import loom
from loom.dist.context import unsharded
from loom.models.gpt import GPT, GPTConfig
from loom.models.recipes import RECIPES, Recipe, find_blocks, recipe_for
from loom.parallel import make_optimizer
from loom.parallel.pipeline import (
    block_split,
    model_pipeline,
    source_names,
    split_model,
    whole_model,
)
from loom.parallel.zero3 import model_units
from loom.train.trainer import Trainer, global_mean

pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 3, 8, 16


def build(family: str, attention: str = "sdpa") -> torch.nn.Module:
    """The suite's tiny model of `family` with 4 blocks (seed 0: the same values in every process)."""
    model = hf_models.build(family, layers=4)
    model.set_attn_implementation(attention)
    return model


def batches() -> list[torch.Tensor]:
    """The runs' token ids, one (BATCH, SEQ) tensor per step; the labels are the ids (the model shifts)."""
    return hf_models.batches(STEPS, BATCH, SEQ, seed=0)


@functools.cache
def reference(family: str) -> dict:
    """One device, the model's own forward and loss: losses, gradients, parameters after `STEPS` steps, and
    the evaluation loss of the first batch then."""
    model = build(family)
    optimizer, losses, grads = adamw(model.parameters()), [], []
    for ids in batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        evaluation = model(batches()[0], labels=batches()[0]).loss.item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    norms = [
        torch.linalg.vector_norm(torch.stack([g.norm() for g in step.values()])).item() for step in grads
    ]
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "evaluation": evaluation}


def pipeline_case(
    family: str, dp: int, level: int, schedule: str, split: list[int] | None, virtual: int = 1, tp: int = 1,
    ep: int = 1,
) -> dict:  # fmt: skip
    """A worker's run through the `Trainer`: losses, gradient norms, the gradients by the model's names
    (level 0; above, they are sharded), this rank's parameters, the evaluation loss of the first batch, and
    whether the parameters rest sharded. `ep`: each stage's experts cut over ep of its dp ranks."""
    mesh = loom.init({"pp": 2, "dp": dp, "tp": tp})
    with unsharded():
        model = build(family)
    pipe = model_pipeline(model, mesh, schedule=schedule, microbatches=2, split=split, virtual=virtual, ep=ep)
    optimizer = make_optimizer(pipe, torch.optim.AdamW, level, **ADAMW)
    names = {
        id(p): n
        for stage in pipe.modules
        for n, p in zip(source_names(model, stage), stage.parameters(), strict=True)
    }
    grads = []
    step = optimizer.step

    def recording_step(*args, **kwargs):  # the step's reduced gradients, before the update
        grads.append(
            {names[id(p)]: loom.full(p.grad).clone() for p in pipe.parameters() if p.grad is not None}
        )
        return step(*args, **kwargs)

    optimizer.step = recording_step
    trainer = Trainer(pipe, optimizer)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    metrics = [trainer.train_step([(rows(ids), rows(ids))]) for ids in batches()]
    first = rows(batches()[0])
    evaluation = trainer.evaluate([(first, first)]) if schedule != "zbv" else None  # zbv: no eval in torch
    sharded = pipe.sharding is not None and all(
        p.untyped_storage().nbytes() == 0 for bucket in pipe.grad_sync.buckets for p in bucket.params
    )
    with pipe.full_parameters():
        params = {names[id(p)]: loom.full(p.detach()).clone() for p in pipe.parameters()}
    experts = [  # with ep: this rank's experts of each layer (their local shards' sizes)
        stage.blocks[0].mlp.experts.down_proj.to_local().shape[0] for stage in pipe.modules if ep > 1
    ]
    mine = {id(p) for p in pipe.parameters()}
    others_on_meta = all(p.is_meta for p in model.parameters() if id(p) not in mine)
    whole = dict(whole_model(model, pipe, mesh, split=split).named_parameters())
    return {
        "losses": [m.loss for m in metrics], "norms": [m.grad_norm for m in metrics], "grads": grads,
        "params": params, "evaluation": evaluation, "sharded": sharded, "whole": whole,
        "others_on_meta": others_on_meta, "local_experts": experts,
    }  # fmt: skip


def assert_matches(family: str, results: list[dict], level: int) -> None:
    """Every rank's losses, gradient norms, evaluation loss, gradients (level 0) and parameters are one
    device's, and the ranks hold every parameter of the model."""
    expected = reference(family)
    for result in results:
        for key in ("losses", "norms"):
            torch.testing.assert_close(
                torch.tensor(result[key]), torch.tensor(expected[key]), rtol=RTOL, atol=0, msg=key
            )
        if result["evaluation"] is not None:
            torch.testing.assert_close(result["evaluation"], expected["evaluation"], rtol=RTOL, atol=0)
        if level == 0:
            for got, want in zip(result["grads"], expected["grads"], strict=True):
                for name, grad in got.items():
                    torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=GRAD_ATOL, msg=name)
        params = result["params"]
        assert_params_close(params, {n: expected["params"][n] for n in params}, lr=ADAMW["lr"], steps=STEPS)
        assert result["others_on_meta"], "other ranks' stages hold no memory here"
        # the trained model, whole on every rank
        assert_params_close(result["whole"], expected["params"], lr=ADAMW["lr"], steps=STEPS)
    every = {name for result in results for name in result["params"]}
    assert every == set(expected["params"]), "the stages hold every parameter of the model"
    if level == 0:
        compared = {name for result in results for name in result["grads"][0]}
        assert compared == set(expected["params"]), "every gradient is compared"


LLAMA_PATHS = [
    ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"],
    ["model.layers.3", "model.norm", "lm_head"],
]
SLOW = pytest.mark.slow  # more combinations of the same features


def _values(case) -> tuple:
    return case.values if hasattr(case, "values") else case


def _split_id(split) -> str:
    if split is None:
        return "even"
    return "paths" if isinstance(split[0], list) else str(split)


CASES = [  # (family, dp, level, schedule, split, virtual stages per rank, tp)
    ("gpt2", 1, 0, "1f1b", None, 1, 1),  # tied head: copies on both pipeline ranks
    ("llama", 1, 0, "gpipe", [1, 3], 1, 1),
    ("llama", 1, 0, "1f1b", LLAMA_PATHS, 1, 1),  # a Plan's stages as module paths
    pytest.param("mixtral", 1, 0, "1f1b", None, 1, 1, marks=SLOW),
    pytest.param("gpt2", 1, 0, "interleaved", [1, 1, 1, 1], 2, 1, marks=SLOW),
    pytest.param("llama", 1, 0, "zbv", None, 2, 1, marks=SLOW),  # V: the first and the last stage on rank 0
    ("gpt2", 2, 0, "1f1b", None, 1, 1),
    ("llama", 2, 0, "1f1b", [3, 1], 1, 1),
    ("llama", 2, 3, "1f1b", None, 1, 1),
    ("gpt2", 2, 3, "1f1b", None, 1, 1),  # level 3 with tied copies on two pipeline ranks
    # tensor parallelism inside the stages (Megatron's layouts from the recipes), rotary positions
    ("llama", 1, 0, "1f1b", None, 1, 2),
    pytest.param("llama", 2, 0, "1f1b", [3, 1], 1, 2, marks=SLOW),
]


@pytest.mark.parametrize(
    ("family", "dp", "level", "schedule", "split", "virtual", "tp"),
    CASES,
    ids=[
        f"{f}-dp{dp}-tp{tp}-pp2-level{lv}-{s}-{_split_id(split)}"
        for f, dp, lv, s, split, _, tp in map(_values, CASES)
    ],
)
def test_hugging_face_pipeline_matches_one_device(dist_run, family, dp, level, schedule, split, virtual, tp):
    results = dist_run(2 * dp * tp, pipeline_case, family, dp, level, schedule, split, virtual, tp)
    assert_matches(family, results, level)
    if level == 3:  # every bucketed parameter holds no memory between steps
        assert all(result["sharded"] for result in results)


def data_parallel_level3_case(family: str) -> dict:
    """dp=2 without a pipeline at optimizer level 3: losses, parameters, the bytes the blocks' parameters
    hold between steps, and the units."""
    mesh = loom.init({"dp": 2})
    model = build(family)
    loom.parallelize(model, mode="data_parallel")
    optimizer = make_optimizer(model, torch.optim.AdamW, 3, **ADAMW)
    losses = []
    for ids in batches():
        rows = ids.chunk(2)[mesh.dp_rank()]
        loss = model(rows, labels=rows).loss
        loss.backward()
        losses.append(global_mean([loss.detach()]))
        optimizer.step()
        optimizer.zero_grad()
    blocks = model.get_submodule(recipe_for(model).blocks)
    resting = sum(p.untyped_storage().nbytes() for p in blocks.parameters())
    with model.loom.full_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = [type(u).__name__ for u in optimizer.sharding.units]
    return {"losses": losses, "params": params, "resting": resting, "units": units}


UNITS = {  # each block, each module before or after the blocks that no other unit uses, the root
    "gpt2": ["GPT2Block"] * 4 + ["Embedding", "LayerNorm", "GPT2LMHeadModel"],  # the tied table: in the root
    "llama": ["LlamaDecoderLayer"] * 4 + ["Embedding", "LlamaRMSNorm", "Linear", "LlamaForCausalLM"],
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_data_parallel_at_level_3_matches_one_device(dist_run, family):
    expected = reference(family)
    for result in dist_run(2, data_parallel_level3_case, family):
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=RTOL, atol=0
        )
        assert_params_close(result["params"], expected["params"], lr=ADAMW["lr"], steps=STEPS)
        assert result["resting"] == 0, "the blocks' parameters are sharded at rest"
        assert result["units"] == UNITS[family]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recipes_find_every_module_and_cut_uneven_splits(attention):
    for family in ("gpt2", "llama", "mixtral"):
        model = build(family, attention)
        recipe = recipe_for(model)
        assert recipe is RECIPES[type(model).__name__]
        assert all(part is not None for part in recipe.parts(model).values())  # every path exists
        stages = split_model(model, 3, split=[1, 2, 1])
        assert [s.block_indices for s in stages] == [[0], [1, 2], [3]]
        assert [(s.first, s.last) for s in stages] == [(True, False), (False, False), (False, True)]
        ids = batches()[0]
        x = ids
        for stage in stages:
            x = stage(x)
        torch.testing.assert_close(x, model(ids).logits, rtol=0, atol=0)  # the same operations
    gpt = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, max_seq_len=8, positions="rotary"))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    x = ids
    for stage in split_model(gpt, 2, split=[3, 1]):
        x = stage(x)
    torch.testing.assert_close(x, gpt(ids), rtol=0, atol=0)
    assert block_split(14, 4, [3, 4, 4, 3]) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13]]
    assert sorted(len(group) for group in block_split(14, 4)) == [3, 3, 4, 4]  # even by default
    assert find_blocks(build("llama"))[0] == "model.layers"


class Toy(torch.nn.Module):
    """A model loom has no recipe for: an input layer (a parameter-free one without `projection`), then
    blocks at `layers`."""

    def __init__(self, projection: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8) if projection else torch.nn.Identity()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_model_without_a_recipe_runs_its_found_blocks_or_a_given_recipe():
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(2, 8)
    with pytest.raises(
        ValueError, match=r"parameters \['embed.weight', 'embed.bias'\] are in no pipeline stage"
    ):
        split_model(model, 2)  # blocks found at `layers`, but the input layer is in no stage
    y = x
    for stage in split_model(model, 2, recipe=Recipe(family="toy", blocks="layers", before=("embed",))):
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    model = Toy(projection=False)  # blocks alone: the block list found at `layers` is the whole recipe
    y = x
    for stage in split_model(model, 2, split=[1, 3]):
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)


def test_models_without_a_recipe_and_bad_splits_are_clear_errors():
    with pytest.raises(ValueError, match=r"no block list at .*no recipe for Linear .*Recipe\(family="):
        split_model(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match=r"has no block list at any of .*pass the path of its block list"):
        find_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"has no module 'model.layers', which recipe 'mine' names"):
        split_model(torch.nn.Linear(2, 2), 2, recipe=Recipe(family="mine", blocks="model.layers"))
    with pytest.raises(ValueError, match=r"split \[1, 2\]: give 2 block counts .* summing to the model's 4"):
        split_model(build("llama"), 2, split=[1, 2])
    bad_paths = [["model.layers.0", "model.norm"], ["model.layers.1", "model.layers.2", "model.layers.3"]]
    with pytest.raises(ValueError, match=r"stage 0 names 'model.norm', which is neither a block"):
        split_model(build("llama"), 2, split=bad_paths)
    with pytest.raises(ValueError, match=r"stages name blocks \[0, 2, 1, 3\]: a pipeline runs consecutive"):
        split_model(
            build("llama"),
            2,
            split=[["model.layers.0", "model.layers.2"], ["model.layers.1", "model.layers.3"]],
        )
    with pytest.raises(ValueError, match="5 pipeline stages for 4 blocks"):
        split_model(build("llama"), 5)
    assert len(model_units(build("llama"))) == 4 + 3 + 1  # blocks, embedding, norm, head, root
    router = build("mixtral")
    router.config.output_router_logits = True
    with pytest.raises(ValueError, match="router's auxiliary loss.*output_router_logits = False"):
        split_model(router, 2)


def tied_tensor_parallel_case() -> str:
    mesh = loom.init({"pp": 2, "tp": 2})
    with unsharded():
        model = build("gpt2")
    try:
        model_pipeline(model, mesh, schedule="1f1b", microbatches=2)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_head_tied_across_pipeline_ranks_is_refused_with_tensor_parallel_stages(dist_run):
    for message in dist_run(4, tied_tensor_parallel_case):
        assert "is tied between pipeline stages" in message, message
        assert "tie_word_embeddings = False" in message


def test_a_copy_gathered_whole_runs_its_own_local_regions():
    """`whole_model` deep-copies a model whose experts run as local regions (Mixtral with tp): the copy's
    experts must run their own forward, not the shared wrapper, which calls the original module's."""
    from loom.parallel.local_region import run_locally, run_normally

    model = build("mixtral")
    run_locally(model.model.layers[0].mlp.experts, "model.layers.0.mlp.experts")
    copy = deepcopy(model)
    copied, ids = copy.model.layers[0].mlp.experts, batches()[0]
    with torch.no_grad():
        copied.down_proj.zero_()  # the copy's experts now add nothing
        assert torch.equal(copy(ids).logits, model(ids).logits)  # the wrapper ran the original's experts
        run_normally(copy)
        assert not torch.equal(copy(ids).logits, model(ids).logits)
    assert not hasattr(copied, "loom_local")
