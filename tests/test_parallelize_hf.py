"""Hugging Face models, unedited, under `loom.parallelize(mode="semi_auto", module_plan=...)`: the same
losses, gradients and parameters as one device (tolerances: tests/equivalence.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, adamw, assert_params_close, train_steps
from hf_models import batches, build
from torch.distributed.tensor.debug import CommDebugMode

import loom
from loom.dist.comm import collective_counts
from loom.models.recipes import tensor_plan
from loom.parallel import make_optimizer
from loom.plan import Plan

LR = 3e-3


def _train(model, data, local=lambda t: t, level=0):
    optimizer = (
        make_optimizer(model, torch.optim.AdamW, level, **(ADAMW | {"lr": LR}))
        if level
        else adamw(model.parameters(), lr=LR)
    )

    def loss_of(ids):
        ids = local(ids)
        return model(input_ids=ids, labels=ids).loss

    # above level 1 the gradients are sharded (ZeRO): compared at level 0 only
    return train_steps(model, optimizer, data, loss_of, keep_grads=not level)


def tensor_parallel_case(family, dp, tp, plan_dir=None, level=0):
    reference = build(family)
    model = copy.deepcopy(reference)
    data = batches()
    expected = _train(reference, data)
    mesh = loom.init({"dp": dp, "tp": tp})
    if plan_dir is None:
        loom.parallelize(model, mode="semi_auto", module_plan=tensor_plan(model))
    else:  # the same layouts from a Plan saved as JSON, with the MLPs recomputed
        path = Path(plan_dir) / f"{family}.json"
        plan = Plan(dp=dp, tp=tp, strategies=tensor_plan(model), recompute_modules=RECOMPUTED[family])
        if loom.rank() == 0:
            plan.save(path)
        dist.barrier()
        loom.parallelize(model, plan=path)
        assert model.loom.plan == plan and model.loom.mode == "semi_auto"
        assert model.get_submodule(_first_mlp(family)).loom_recompute == "full"
    local = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731  (tensor-parallel peers read the same rows)
    actual = _train(model, data, local, level)
    shards = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    return expected, actual, shards


RECOMPUTED = {  # the MLPs in full, and one attention (whose forward lifts tensors it creates) selectively
    "llama": {"*.mlp": "full", "model.layers.1.self_attn": "selective"},
    "gpt2": {"*.mlp": "full", "transformer.h.1.attn": "selective"},
}


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_optimizer_levels_with_megatron_layouts_match_one_device(dist_run, level):
    """States (1), gradients (2) and parameters (3) sharded over the data-parallel replicas of a tensor-
    parallel Llama: a gradient pending along a dim its parameter is cut on (the vocabulary-parallel head's) is
    cut like its parameter before the buckets take it."""
    for expected, actual, _ in dist_run(4, tensor_parallel_case, "llama", 2, 2, None, level):
        (ref_losses, _, ref_params), (losses, _, params) = expected, actual
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
        assert_params_close(params, ref_params, lr=LR, steps=len(losses))


def _first_mlp(family):
    return "transformer.h.0.mlp" if family == "gpt2" else "model.layers.0.mlp"


def _assert_equivalent(expected, actual):
    (ref_losses, ref_grads, ref_params), (losses, grads, params) = expected, actual
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=RTOL, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert_params_close(params, ref_params, lr=LR, steps=len(losses))


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow), "mixtral"])
def test_megatron_layouts_on_hugging_face_models_match_one_device(dist_run, family):
    for expected, actual, shards in dist_run(4, tensor_parallel_case, family, 2, 2):
        _assert_equivalent(expected, actual)
        if family == "gpt2":
            assert shards["transformer.h.0.mlp.c_fc.weight"] == (64, 128)  # (in, out / tp)
        else:
            assert shards["model.layers.0.self_attn.q_proj.weight"] == (32, 64)  # (out / tp, in)
            assert shards["model.layers.0.self_attn.o_proj.weight"] == (64, 32)


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_a_plan_loaded_from_json_applies_the_same_layouts(dist_run, tmp_path, family):
    for expected, actual, _ in dist_run(4, tensor_parallel_case, family, 2, 2, str(tmp_path)):
        _assert_equivalent(expected, actual)


def wrong_mesh_case():
    loom.init({"dp": 2})
    try:
        loom.parallelize(build("llama"), plan=Plan(dp=1, tp=2))
    except ValueError as error:
        return str(error)


def test_a_plan_for_another_mesh_is_refused(dist_run):
    for message in dist_run(2, wrong_mesh_case):
        assert "the plan's mesh {'dp': 1, 'tp': 2} is not the current mesh {'dp': 2}" in message


def shard_then_parallelize_case():
    """`loom.shard` on one ordinary module of an unedited model, in mesh axis names, then the rest of the
    model by `parallelize`: the shard's layout stays, and training matches one device."""
    reference = build("gpt2")
    model = copy.deepcopy(reference)
    data = batches()
    expected = _train(reference, data)
    mesh = loom.init({"dp": 2, "tp": 2})
    loom.shard(model.transformer.h[1].mlp.c_fc, in_strategy=(("dp", "None", "None"),),
               parameter_plan={"weight": ("None", "tp"), "bias": ("tp",)})  # fmt: skip
    loom.parallelize(model, module_plan={"*.h.1.mlp.c_proj": {"parameter_plan": {"weight": ("tp", "None")}}})
    local = lambda t: t.chunk(2)[mesh.dp_rank()]  # noqa: E731
    actual = _train(model, data, local)
    return expected, actual, tuple(model.transformer.h[1].mlp.c_fc.weight.to_local().shape)


def test_shard_on_an_ordinary_module_keeps_its_layout_inside_parallelize(dist_run):
    for expected, actual, shard in dist_run(4, shard_then_parallelize_case):
        _assert_equivalent(expected, actual)
        assert shard == (64, 128)


def forward_collectives_case(layers):
    loom.init({"tp": 2})
    model = build("llama", layers=layers)
    loom.parallelize(model, module_plan=tensor_plan(model), batch_axes=())
    ids = batches()[0]
    model(input_ids=ids, labels=ids)  # the first forward also checks the ranks' agreement
    with CommDebugMode() as forward:
        loss = model(input_ids=ids, labels=ids).loss
    model.loom.grad_sync.enabled = False  # the buckets' reduction is data parallelism's, counted elsewhere
    with CommDebugMode() as backward:
        loss.backward()
    return collective_counts(forward), collective_counts(backward)


def test_megatron_plan_issues_megatrons_collectives(dist_run):
    """Forward: one all-reduce after the embedding, one after each row-parallel matrix (two per block), and
    the vocabulary-parallel cross entropy's three per-row all-reduces; nothing gathers the logits. Backward:
    one all-reduce per block's column-parallel inputs (two per block), one for the head's input; no
    reduce-scatter and all-gather pairs. (The cross entropy's per-row sums are all-reduced where they are
    made: left pending, their backward issued one more all-reduce.)"""
    for layers in (1, 3):
        forward, backward = dist_run(2, forward_collectives_case, layers)[0]
        assert forward == {"all_reduce": 1 + 2 * layers + 3}, (layers, forward)
        assert backward == {"all_reduce": 2 * layers + 1}, (layers, backward)


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ({"*.q_prj": {"parameter_plan": {"weight": ("tp", "None")}}}, "did you mean ...'q_proj'?"),
        ({"*.q_proj": {"parameter_pln": {}}}, "did you mean 'parameter_plan'?"),
        (
            {"*.q_proj": {"parameter_plan": {"weight": ("tq", "None")}}},
            "an axis of ('pp', 'dp', 'cp', 'ep', 'tp')",
        ),
        ({"*.q_proj": {"local": True, "in_strategy": ((2, 1),)}}, "give local alone"),
        ({"*.q_proj": "column"}, "use a table with some of the keys"),
    ],
)
def test_module_plan_mistakes_name_the_pattern_and_the_fix(plan, expected):
    from loom.parallel.module_plan import resolve_module_plan

    with pytest.raises(ValueError) as error:
        resolve_module_plan(build("llama"), plan)
    assert expected in str(error.value), str(error.value)
