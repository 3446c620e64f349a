"""Tier 2: loom's MoE GPT cut into pipeline stages whose experts are cut over ep, against one device.

A tiny MoE GPT (2 layers, d_model 32, 4 SwiGLU experts, top-2, dropless, balancing loss, z-loss and the
balancing bias) trains 5 steps of Lipschitz AdamW (tests/equivalence.py) with clipping, cut into 2 pipeline
stages each run by the data-parallel ranks of its pipeline rank, the stage's experts cut over ep of them:
pp 2 x dp 2 with ep 2 on 4 ranks (1f1b at optimizer levels 0 and 3), and, marked slow, gpipe at level 1,
the interleaved (level 2) and zbv schedules (4 layers, two stages per rank), pp 2 x dp 4 with ep 2 on 8
ranks at level 3 (an expert-dp group of 2: the expert shards sharded at rest) and pp 2 x dp 2 x tp 2 with
ep 2. The balancing losses are those of each micro-batch's tokens over every replica, so the reference is
one device accumulating the same micro-batches (the k-th of every replica's rows, together). Compared:
losses and gradient norms (rtol 1e-5), every whole parameter (`assert_params_close`) and the balancing
biases (exactly: the loads are integers); each rank's expert shards are the same within an expert-dp group
and differ across the ep group. Also: the config's `[parallel] pp` with `ep`, `loom train` with them (slow),
and an unedited Mixtral with ep in its pipeline stages.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, assert_params_close
from job_cases import job_config
from test_pipeline_hf import assert_matches, pipeline_case

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.models.moe import moe_layers
from loom.parallel import make_optimizer
from loom.parallel.pipeline import gpt_pipeline, source_names
from loom.train import Trainer
from loom.train.config import load_config
from loom.train.job import run

STEPS, GLOBAL_BATCH, SEQ, CLIP = 5, 8, 8, 0.5
CONFIG = GPTConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, mlp="swiglu", experts=4, top_k=2,
    z_loss_coef=1e-3, expert_bias_rate=1e-2,
)  # fmt: skip


VIRTUAL = {"interleaved": 2, "zero_bubble": 2, "zbv": 2}  # stages per rank (4 layers: one block each)


def _config(schedule: str) -> GPTConfig:
    return dataclasses.replace(CONFIG, n_layers=2 * VIRTUAL.get(schedule, 1))


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _micro_batches(batch, dp: int, microbatches: int) -> list[tuple]:
    """The pipeline's micro-batches of the whole batch: the k-th of every replica's rows, together."""
    return [
        tuple(torch.cat([rows.chunk(microbatches)[k] for rows in t.chunk(dp)]) for t in batch)
        for k in range(microbatches)
    ]


def _biases(modules) -> dict[str, torch.Tensor]:
    return {name: m.expert_bias.clone() for name, m in modules if hasattr(m, "expert_bias")}


@functools.cache
def _reference(dp: int, microbatches: int, schedule: str):
    """One device accumulating the pipeline's micro-batches: losses, norms, parameters, biases."""
    model = GPT(_config(schedule))
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 0, **ADAMW), clip_grad_norm=CLIP)
    metrics = [trainer.train_step(_micro_batches(batch, dp, microbatches)) for batch in _batches()]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    biases = _biases((name, m) for name, m in model.named_modules() if m in set(moe_layers(model)))
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], params, biases


def _shards(model, pipe, mesh, ep: int) -> list[str]:
    """Within a stage, ranks at the same place of their ep group hold the same expert shard (expert-dp);
    across the ep group they differ."""
    errors = []
    stage = pipe.modules[0]
    weight = next(moe for moe in moe_layers(stage)).experts.down_proj
    local = weight.to_local().contiguous()
    if local.shape[0] != CONFIG.experts // ep:
        errors.append(f"local experts {local.shape[0]} != {CONFIG.experts // ep}")
    peers = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(peers, local)  # the first layer of each pipeline rank's stage: same shapes everywhere
    tp = mesh.axis_size("tp")
    for rank, peer in enumerate(peers):
        pp_rank, dp_rank = rank // (mesh.dp_size * tp), rank % (mesh.dp_size * tp) // tp
        if pp_rank != mesh.axis_rank("pp"):
            continue
        same = dp_rank % ep == mesh.dp_rank() % ep
        if same != torch.equal(peer, local):
            errors.append(f"rank {rank}: shard {'differs' if same else 'equal'} (same experts: {same})")
    return errors


def ep_pipeline_case(schedule: str, dp: int, tp: int, ep: int, microbatches: int, level: int):
    """5 Trainer steps of the MoE GPT's pipeline on pp 2 x dp x tp, experts cut over ep of each stage."""
    mesh = loom.init({"pp": 2, "dp": dp} | ({"tp": tp} if tp > 1 else {}))
    with torch.device("meta"):  # as `loom train` builds it: each rank materialises its stages only
        model = GPT(_config(schedule), Strategies(dp, tp, tp > 1, ep))
    virtual = VIRTUAL.get(schedule, 1)
    pipe = gpt_pipeline(model, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual)
    trainer = Trainer(pipe, make_optimizer(pipe, torch.optim.AdamW, level, **ADAMW), clip_grad_norm=CLIP)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    metrics = [trainer.train_step([(rows(ids), rows(targets))]) for ids, targets in _batches()]
    params, biases = {}, {}
    experts = next(moe for moe in moe_layers(pipe.modules[0])).experts.up_proj.to_local()
    at_rest = experts.untyped_storage().nbytes()
    with pipe.full_parameters():  # level 3: sharded at rest
        errors = _shards(model, pipe, mesh, ep)
        if level == 3 and (at_rest == 0) != (dp // ep > 1):  # sharded over an expert-dp group of 2+
            errors.append(f"level 3: the expert shard holds {at_rest} bytes at rest (expert-dp {dp // ep})")
        for stage in pipe.modules:
            for name, p in zip(source_names(model, stage), stage.parameters(), strict=True):
                params[name] = loom.full(p.detach()).clone()
            layers = set(moe_layers(stage))
            biases |= _biases((n, m) for n, m in model.named_modules() if m in layers)
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], params, biases, errors


CASES = [  # (schedule, dp, tp, ep, micro-batches, optimizer level)
    ("1f1b", 2, 1, 2, 2, 0),
    pytest.param(("gpipe", 2, 1, 2, 2, 1), marks=pytest.mark.slow),
    ("1f1b", 2, 1, 2, 2, 3),  # each stage's parameters gathered around its work, experts over expert-dp
    pytest.param(("interleaved", 2, 1, 2, 2, 2), marks=pytest.mark.slow),  # two stages per rank
    pytest.param(("zbv", 2, 1, 2, 2, 0), marks=pytest.mark.slow),  # split backward: the weight pass apart
    pytest.param(("1f1b", 4, 1, 2, 2, 3), marks=pytest.mark.slow),  # an expert-dp group of 2 per stage
    pytest.param(("1f1b", 2, 2, 2, 2, 0), marks=pytest.mark.slow),  # ep x tp x pp
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-dp{c[1]}-tp{c[2]}-ep{c[3]}-level{c[5]}")
def test_expert_parallel_pipeline_matches_one_device(dist_run, case):
    schedule, dp, tp, ep, microbatches, level = case
    expected, expected_norms, reference, expected_biases = _reference(dp, microbatches, schedule)
    results = dist_run(2 * dp * tp, ep_pipeline_case, *case)
    trained = set()
    for rank, (losses, norms, params, biases, errors) in enumerate(results):
        where = f"rank {rank} of {case}"
        assert not errors, f"{where}: {errors}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0, msg=where)
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0, msg=where
        )
        assert_params_close(params, {n: reference[n] for n in params}, lr=ADAMW["lr"], steps=STEPS)
        assert biases and all(torch.equal(b, expected_biases[n]) for n, b in biases.items()), where
        trained |= set(params)
    assert trained == set(reference), "every parameter lives on some stage"


def test_a_config_with_experts_and_a_pipeline_cuts_each_stage_s_experts():
    overrides = ["--model.d_model", "32", "--train.global_batch", "8", "--model.experts", "4"]
    config = load_config(
        None, [*overrides, "--parallel.pp", "2", "--parallel.ep", "2", "--parallel.microbatches", "2"]
    )
    config.validate(4)
    plan = config.plan(4)
    assert (plan.pp, plan.dp, plan.ep) == (2, 2, 2)


@pytest.mark.slow
def test_loom_train_with_a_pipeline_and_ep_follows_one_device(dist_run, tmp_path):
    """The job `loom train` runs: `[parallel] pp = 2, ep = 2` (dp 2) gives the one-device losses. Without
    balancing losses or bias, routing is per token, so the micro-batches' grouping changes nothing."""
    moe = {"experts": 4, "mlp": "swiglu", "aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    one = job_config(tmp_path, model=moe, parallel={"dp": 1}, train={"workers": 1, "steps": 3})
    parallel = {"dp": 2, "pp": 2, "ep": 2, "microbatches": 2}
    four = job_config(tmp_path, model=moe, parallel=parallel, train={"workers": 4, "steps": 3})
    expected = dist_run(1, run, one)[0]["losses"]
    assert len(expected) == 3
    assert dist_run(4, run, four)[0]["losses"] == pytest.approx(expected, rel=RTOL)


HF_CASES = [  # (dp, optimizer level, schedule): pp 2, ep 2
    (2, 0, "1f1b"),
    pytest.param((2, 1, "gpipe"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: f"dp{c[0]}-level{c[1]}-{c[2]}")
def test_hugging_face_mixtral_with_ep_in_pipeline_stages_matches_one_device(dist_run, case):
    """An unedited Mixtral (4 layers, 4 experts, top-2) cut into 2 stages, each stage's experts cut over ep 2
    of its dp 2 (`model_pipeline(..., ep=2)`): one device's losses, gradient norms, gradients (level 0),
    parameters, evaluation loss and whole model; every rank holds 2 of each layer's 4 experts."""
    dp, level, schedule = case
    results = dist_run(2 * dp, pipeline_case, "mixtral", dp, level, schedule, None, 1, 1, 2)
    assert_matches("mixtral", results, level)
    assert all(result["local_experts"] == [2] for result in results)
