"""Pipelines in the Trainer and in `loom train`.

Tier 2: the reference GPT trained 3 steps by the `Trainer` (every schedule at pp=2, 1f1b at pp=4, dp x pp
on 4 ranks, tied embeddings; clipping on, some cases accumulating; tensor parallelism inside the stages: tp x
pp on 4 ranks and dp x tp x pp on 8, with sequence parallelism; optimizer levels 1 and 2 over dp x pp and
dp x tp x pp) gives the single-device Trainer's losses, gradient norms, parameters and evaluation loss; a
non-finite step changes nothing on any stage; the mesh's pp and dp groups, and a stage's mesh within one
pipeline rank. `loom train`: the combinations not supported
yet fail clearly (tier 1); a pipeline run's checkpoint (also with tp x pp, and at optimizer levels 1-2)
equals one device's and resumes on one device; a run with a pipeline learns (tier 3).
"""

import dataclasses
import functools
import json
import re
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, assert_params_close
from job_cases import job_config
from test_pipeline_equivalence import BATCH, CONFIG, SEQ, STEPS, batches, optimizer
from torch.distributed.tensor import DTensor

import loom
from loom.checkpoint.export import read_model_tensors
from loom.cli.main import main
from loom.cost.traffic import summary
from loom.cost.transformer import transformer_config
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.pipeline import gpt_pipeline, source_names
from loom.plan import Plan
from loom.train.config import TrainConfig, load_config
from loom.train.data import micro_batches
from loom.train.job import all_stages, check_pipeline, run
from loom.train.trainer import Trainer

CLIP = 0.1  # below every step's gradient norm (about 0.3 to 0.5 here), so that clipping acts


def _gpt_config(tied: bool) -> GPTConfig:
    return dataclasses.replace(CONFIG, tie_embeddings=tied)


@functools.cache
def _reference(accum: int, tied: bool):
    """The single-device Trainer's losses, gradient norms, parameters and evaluation loss (run in the test
    process)."""
    model = GPT(_gpt_config(tied))
    trainer = Trainer(model, optimizer(model.parameters()), grad_accum=accum, clip_grad_norm=CLIP)
    metrics = [trainer.train_step(micro_batches(batch, accum)) for batch in batches()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    evaluation = trainer.evaluate([batches()[0]])
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], evaluation, params


def pipeline_trainer_case(
    schedule, dp, pp, virtual, microbatches, accum, tied, tp=1, sequence_parallel=False, level=0
):
    mesh = loom.init({"pp": pp, "dp": dp} | ({"tp": tp} if tp > 1 else {}))
    with torch.device("meta"):  # as `loom train` builds it: each rank materialises its stages only
        model = GPT(_gpt_config(tied), Strategies(dp, tp, sequence_parallel))
    pipe = gpt_pipeline(model, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual)
    optim = make_optimizer(pipe, torch.optim.AdamW, level, **ADAMW)
    trainer = Trainer(pipe, optim, grad_accum=accum, clip_grad_norm=CLIP)
    rows = [tuple(t.chunk(dp)[mesh.dp_rank()] for t in batch) for batch in batches()]
    metrics = []
    for batch in rows:
        with CollectiveRecorder() as recorder:  # the last step's collectives are compared with the Plan's
            metrics.append(trainer.train_step(micro_batches(batch, accum)))
    sizes = {axis: size for axis, size in {"pp": pp, "dp": dp, "tp": tp}.items() if size > 1}
    recorded = recorder.summary(mesh_axes(tuple(sizes), tuple(sizes.values()), dist.get_rank()))
    if level:  # each replica keeps states for its chunk of the stage's elements only
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in pipe.parameters())
        assert sum(shard.master.numel() for shard in optim.shards) < local * 0.6
    params = {  # whole parameters (a tensor-parallel stage's shards gathered over its stage mesh)
        name: loom.full(p.detach())
        for stage in pipe.modules
        for name, p in zip(source_names(model, stage), stage.parameters(), strict=True)
    }
    # torch's zbv schedule has no forward-only path (Pipeline.evaluate says so)
    evaluation = trainer.evaluate([rows[0]]) if schedule != "zbv" else None
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], evaluation, params, recorded


CASES = [  # (schedule, dp, pp, virtual stages per rank, pipeline micro-batches, Trainer micro-batches, tied)
    ("gpipe", 1, 2, 1, 4, 1, False),
    ("1f1b", 1, 2, 1, 4, 2, False),
    ("interleaved", 1, 2, 2, 4, 1, False),
    ("zero_bubble", 1, 2, 2, 4, 1, False),
    ("zbv", 1, 2, 2, 4, 1, False),
    ("1f1b", 1, 4, 1, 8, 1, False),
    ("1f1b", 2, 2, 1, 2, 2, False),
    # tied embeddings: the first and the last stage sum their gradients (zbv: both stages on one rank)
    ("1f1b", 1, 2, 1, 4, 1, True),
    ("zbv", 1, 2, 2, 4, 1, True),
    ("interleaved", 2, 2, 2, 2, 1, True),
]


@pytest.mark.parametrize(("schedule", "dp", "pp", "virtual", "microbatches", "accum", "tied"), CASES)
def test_pipeline_trainer_matches_one_device(dist_run, schedule, dp, pp, virtual, microbatches, accum, tied):
    _check_against_one_device(dist_run, (schedule, dp, pp, virtual, microbatches, accum, tied))


TP_CASES = [  # (schedule, dp, pp, virtual, micro-batches, Trainer micro-batches, tied, tp, sequence parallel)
    # make test samples: 1f1b with tp x pp runs there as the 8-rank level-1 case of
    # test_optimizer_levels_with_a_pipeline_match_one_device
    pytest.param(("1f1b", 1, 2, 1, 4, 1, False, 2, False), marks=pytest.mark.slow),
    ("zbv", 1, 2, 2, 4, 1, True, 2, True),  # the tied table's two users share one tensor on rank 0
    # dp x tp x pp on 8 ranks (make test runs the 8-rank interleaved case of test_pipeline_rotary.py)
    pytest.param(("interleaved", 2, 2, 2, 2, 2, True, 2, True), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: f"{c[0]}-dp{c[1]}-tp{c[7]}-pp{c[2]}-sp{int(c[8])}")
def test_tensor_parallel_pipeline_matches_one_device(dist_run, case):
    """Stages laid out tensor-parallel on their own dp x tp ranks give one device's losses, gradient norms,
    parameters and evaluation loss."""
    _check_against_one_device(dist_run, case)


LEVEL_CASES = [  # TP_CASES' fields, then the optimizer level: states (level 2: gradients) sharded over dp
    ("gpipe", 2, 2, 1, 2, 1, False, 1, False, 1),
    ("1f1b", 2, 2, 1, 2, 2, True, 1, False, 1),
    ("interleaved", 2, 2, 2, 2, 1, True, 1, False, 1),  # two stages per rank
    ("1f1b", 2, 2, 1, 2, 2, True, 1, False, 2),
    ("interleaved", 2, 2, 2, 2, 1, True, 1, False, 2),
    ("zbv", 2, 2, 2, 2, 1, True, 1, False, 2),  # the tied table's two users share one tensor on rank 0
    ("1f1b", 2, 2, 1, 2, 1, True, 2, True, 1),  # dp x tp x pp on 8 ranks
    pytest.param(("interleaved", 2, 2, 2, 2, 2, True, 2, True, 2), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    "case", LEVEL_CASES, ids=lambda c: f"{c[0]}-dp{c[1]}-tp{c[7]}-pp{c[2]}-v{c[3]}-level{c[9]}"
)
def test_optimizer_levels_with_a_pipeline_match_one_device(dist_run, case):
    """Optimizer levels 1 and 2 shard a stage's states (and gradients) over the ranks that run it, and give
    one device's losses, gradient norms, parameters and evaluation loss."""
    _check_against_one_device(dist_run, case)


def _check_against_one_device(dist_run, case):
    schedule, dp, pp, _, _, accum, tied, *tensor_parallel = case
    expected, expected_norms, expected_eval, reference = _reference(accum, tied)
    assert min(expected_norms) > CLIP, "the case must clip"
    tp = tensor_parallel[0] if tensor_parallel else 1
    results = dist_run(dp * tp * pp, pipeline_trainer_case, *case)
    if dp > 1 and tp > 1:  # dp x tp x pp: one loss reduction per step, no per-micro-batch batch check
        _check_collectives(case, [recorded for *_, recorded in results])
    for losses, norms, evaluation, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0)
        if evaluation is not None:
            assert evaluation == pytest.approx(expected_eval, rel=RTOL)
        assert_params_close(params, {name: reference[name] for name in params}, lr=ADAMW["lr"], steps=STEPS)
    trained = set().union(*(params for *_, params, _ in results))
    assert trained == set(reference), "every parameter lives on some stage"


def _check_collectives(case, recorded: list) -> None:
    """Each rank's last step issued the collectives the Plan predicts for its pipeline rank."""
    schedule, dp, pp, virtual, microbatches, accum, tied, tp, sequence_parallel, *level = case
    plan = Plan(
        dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=virtual, micro_batches=microbatches,
        sequence_parallel=sequence_parallel, optimizer_level=level[0] if level else 0,
    )  # fmt: skip
    model = transformer_config(_gpt_config(tied))
    for rank, counts in enumerate(recorded):
        expected = summary(
            plan.predicted_collectives(
                model, global_batch=BATCH, seq=SEQ, counted_loss=False, pp_rank=rank // (dp * tp),
                accumulation=accum,
            )
        )  # fmt: skip
        assert counts == expected, (rank, counts - expected, expected - counts)


def nonfinite_case():
    mesh = loom.init({"pp": 2, "dp": 1})
    with torch.device("meta"):
        model = GPT(CONFIG)
    pipe = gpt_pipeline(model, mesh, schedule="1f1b", microbatches=2)
    trainer = Trainer(pipe, optimizer(pipe.parameters()), clip_grad_norm=CLIP)
    if pipe.has_first:  # poison one entry of the first stage: the loss on the last stage is NaN
        with torch.no_grad():
            model.embedding[0, 0] = float("nan")
    before = [p.detach().clone() for p in pipe.parameters()]
    metrics = trainer.train_step([batches()[0]])
    unchanged = all(
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(before, pipe.parameters(), strict=True)
    )
    return metrics.skipped, unchanged, trainer.step


def test_a_nonfinite_step_changes_no_stage(dist_run):
    assert dist_run(2, nonfinite_case) == [(True, True, 1)] * 2


def stage_mesh_case():
    mesh = loom.init({"pp": 2, "dp": 2, "tp": 2})
    stage = mesh.without("pp")
    ranks = lambda axis: dist.get_process_group_ranks(stage.axis_group(axis))  # noqa: E731
    return (
        repr(stage),
        ranks("dp"),
        ranks("tp"),
        dist.get_process_group_ranks(stage.sub_mesh((0, 1)).get_group()),
    )


def test_a_stage_mesh_never_spans_pipeline_ranks(dist_run):
    """`Mesh.without("pp")`: the dp x tp ranks of one pipeline rank (pp outermost: ranks 0-3, then 4-7)."""
    results = dist_run(8, stage_mesh_case)
    for rank, (text, dp, tp, both) in enumerate(results):
        base = rank // 4 * 4
        assert text == "Mesh(dp=2, tp=2; canonical 2 x 2)"
        assert dp == [base + rank % 2, base + rank % 2 + 2] and tp == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert both == [base, base + 1, base + 2, base + 3]


def mesh_groups_case():
    mesh = loom.init({"pp": 2, "dp": 2})
    ranks = lambda axis: dist.get_process_group_ranks(mesh.axis_group(axis))  # noqa: E731
    return ranks("pp"), ranks("dp"), mesh.axis_rank("pp"), mesh.axis_group("tp")


def test_mesh_axis_groups(dist_run):
    """pp is the outer axis: a rank's pipeline holds the ranks dp apart; its replicas are consecutive."""
    results = dist_run(4, mesh_groups_case)
    assert results == [([0, 2], [0, 1], 0, None), ([1, 3], [0, 1], 0, None)] + [
        ([0, 2], [2, 3], 1, None),
        ([1, 3], [2, 3], 1, None),
    ]


# ---- `loom train` with a pipeline --------------------------------------------------------------------------


# the tiny job of job_cases, as a 2-stage pipeline evaluated every 4 of its 8 steps
PIPELINE_JOB = {
    "parallel": {"dp": -1, "pp": 2, "microbatches": 4},
    "train": {"steps": 8, "global_batch": 8, "workers": 2, "eval_every": 4, "eval_batches": 2, "log_every": 2,
              "warmup_steps": 2, "lr": 1e-2},
}  # fmt: skip


def _config(tmp_path, **sections) -> TrainConfig:
    names = {*PIPELINE_JOB, *sections}
    return job_config(tmp_path, **{n: {**PIPELINE_JOB.get(n, {}), **sections.get(n, {})} for n in names})


def _checkpointed(tmp_path, name: str, **sections) -> TrainConfig:
    checkpoint = {"dir": str(tmp_path / name), "every_steps": 2, "keep_last": 10}
    train = {"steps": 6, "eval_every": 0, **sections.pop("train", {})}
    return _config(tmp_path, checkpoint=checkpoint, train=train, **sections)


@pytest.mark.parametrize(
    ("workers", "level"), [(2, 0), (4, 1), (4, 2)], ids=["pp2", "dp2-pp2-level1", "dp2-pp2-level2"]
)
def test_a_pipeline_checkpoint_resumes_on_one_device(dist_run, tmp_path, workers, level):
    """pp=2 (with dp=2: at optimizer levels 1 and 2, the states sharded over each stage's replicas) saves what
    one device saves (by the GPT's parameter names), and one device resumes from it."""
    parallel = {"optimizer_level": level}
    dist_run(workers, run, _checkpointed(tmp_path, "pp", parallel=parallel, train={"workers": workers}))
    one_device = {"parallel": {"pp": 1}, "train": {"workers": 1}}
    dist_run(1, run, _checkpointed(tmp_path, "one", **one_device))
    final = tmp_path / "one" / "step_000006"
    _assert_close(read_model_tensors(tmp_path / "pp" / "step_000006"), read_model_tensors(final))
    shutil.rmtree(tmp_path / "pp" / "step_000006")  # now resume the pipeline's step 4 on one device
    [resumed] = dist_run(1, run, _checkpointed(tmp_path, "pp", **one_device))
    assert len(resumed["losses"]) == 2, "steps 5 and 6 only"
    _assert_close(read_model_tensors(tmp_path / "pp" / "step_000006"), read_model_tensors(final))


def test_a_tensor_parallel_pipeline_checkpoint_equals_one_device(dist_run, tmp_path):
    """`loom train` with pp=2 x tp=2 (sequence parallel) saves what one device saves."""
    parallel = {"pp": 2, "tp": 2, "sequence_parallel": True}
    dist_run(4, run, _checkpointed(tmp_path, "tp_pp", parallel=parallel, train={"workers": 4}))
    dist_run(1, run, _checkpointed(tmp_path, "one", parallel={"pp": 1}, train={"workers": 1}))
    step = "step_000006"
    _assert_close(read_model_tensors(tmp_path / "tp_pp" / step), read_model_tensors(tmp_path / "one" / step))


def _assert_close(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The 6 steps' parameters of two runs of the tiny job (Lipschitz AdamW: job_cases sets train.eps)."""
    assert_params_close(tensors, expected, lr=PIPELINE_JOB["train"]["lr"], steps=6)


@pytest.mark.parametrize(
    ("sections", "fix"),
    [
        ({"parallel": {"schedule": "interleaved"}}, "raise model.n_layers or lower pp"),
    ],
)
def test_unsupported_pipeline_combinations_are_clear_errors(tmp_path, sections, fix):
    with pytest.raises(ValueError, match="parallel.pp = 2") as error:
        check_pipeline(_config(tmp_path, **sections))
    assert fix in str(error.value)


def test_fewer_microbatches_than_stages_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="1 micro-batches for 2 pipeline stages"):
        check_pipeline(_config(tmp_path, parallel={"microbatches": 1}))


def test_supported_pipeline_config_passes(tmp_path):
    check_pipeline(_config(tmp_path))
    check_pipeline(_config(tmp_path, parallel={"pp": 1, "tp": 2, "optimizer_level": 2}))
    check_pipeline(_config(tmp_path, parallel={"tp": 2, "sequence_parallel": True}))
    check_pipeline(_config(tmp_path, model={"positions": "rotary"}))
    check_pipeline(_config(tmp_path, parallel={"dp": 2, "optimizer_level": 3}))


def test_loom_train_with_a_pipeline_learns(tmp_path, capfd):
    config = _config(tmp_path, parallel={"pp": 1, "microbatches": 1})  # the command line sets them
    path = tmp_path / "pp.toml"
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    path.write_text("\n".join(lines) + "\n")
    metrics = tmp_path / "metrics.jsonl"
    code = main(
        ["train", str(path), "--parallel.pp", "2", "--parallel.microbatches", "4",
         "--train.metrics_file", str(metrics)]
    )  # fmt: skip
    out = capfd.readouterr().out
    assert code == 0, out
    assert "plan: Mesh(pp=2, dp=1" in out and "schedule 1f1b with 4 micro-batches" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    assert len(losses) == 4 and len(evals) == 2
    assert all(np.isfinite(losses + evals)) and losses[-1] < losses[0] and evals[-1] < evals[0]


def test_uneven_stages_from_the_config_train_like_even_ones(dist_run, tmp_path):
    """`[parallel] stages = [1, 3]`: 1 block on the first stage, 3 on the second; the losses are the even
    split's (the stages cut the same model), the plan text shows the blocks per stage, and the simulator
    prices the same uneven stages."""
    model, parallel = {"n_layers": 4}, {"dp": 1, "pp": 2, "microbatches": 2}
    even = job_config(tmp_path, model=model, parallel=parallel)
    uneven = job_config(tmp_path, model=model, parallel={**parallel, "stages": [1, 3]})
    assert uneven.plan(2).stages == [1, 3] and uneven.cost_model(2)[1].stage_layers == (1, 3)
    expected = dist_run(2, run, even)[0]["losses"]
    torch.testing.assert_close(
        torch.tensor(dist_run(2, run, uneven)[0]["losses"]), torch.tensor(expected), rtol=RTOL, atol=0
    )
    stages = all_stages(uneven, GPT(uneven.model.gpt_config()))
    assert [len(stage.blocks) for stage in stages] == [1, 3]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([1, 2], "parallel.stages = [1, 2] holds 3 blocks but the model has 4 layers"),
        ([4], "parallel.stages"),
        ([0, 4], "parallel.stages"),
    ],
)
def test_bad_stages_name_the_key(tmp_path, stages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        job_config(
            tmp_path, model={"n_layers": 4}, parallel={"pp": 2, "microbatches": 2, "stages": stages}
        ).validate(2)


def test_stages_on_the_command_line(tmp_path):
    overrides = [
        "--parallel.pp=2",
        "--parallel.microbatches=2",
        "--parallel.stages",
        "1,3",
        "--model.n_layers=4",
    ]
    config = load_config(None, overrides)
    assert config.parallel.stages == (1, 3)
