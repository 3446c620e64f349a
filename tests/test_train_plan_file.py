"""`loom train` on a saved Plan (`[parallel] plan = "plan.json"`) and on the planner's choice
(`[parallel] mode = "auto"`).

Tier 2: a plan written by `loom plan --out` trains on 2 ranks with the losses of the `[parallel]` config that
says the same, and its checkpoint stores that Plan; plans that `[parallel]` cannot spell (3 virtual stages
per pipeline rank; accumulated micro-batches without a pipeline, at optimizer level 2) train with one
device's losses. Tier 3: `loom train` with `mode = "auto"` prints the search, runs the plan it chose and
gives one device's losses. Tier 1: `loom simulate CONFIG` with a plan file prices what `loom simulate --plan`
prices; a plan for another world size or model, or one that disagrees with the config, is a clear error.
"""

import dataclasses
import json
import re

import pytest
import torch
from equivalence import RTOL
from job_cases import job_config

from loom.checkpoint.export import saved_plan
from loom.cli.main import main
from loom.plan import Plan
from loom.train.job import run

# the tiny job of job_cases on 2 workers, its data-parallel size left to the plan
TWO_WORKERS = {"dp": -1}


def _write_toml(config, path):
    """`config` as a TOML file that `loom train` and `loom simulate` read."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def _losses(dist_run, config) -> torch.Tensor:
    return torch.tensor(dist_run(config.train.workers, run, config)[0]["losses"])


def _one_device(tmp_path, model=None):
    return job_config(tmp_path, model=model or {}, parallel={"dp": 1}, train={"workers": 1})


@pytest.fixture(scope="module")
def one_device(dist_run, tmp_path_factory) -> torch.Tensor:
    """The tiny job's losses on one device (its 2-layer model)."""
    return _losses(dist_run, _one_device(tmp_path_factory.mktemp("one_device")))


def test_a_plan_from_loom_plan_trains_like_its_parallel_config(dist_run, tmp_path, capsys):
    toml = _write_toml(job_config(tmp_path, parallel=TWO_WORKERS), tmp_path / "job.toml")
    assert main(["plan", str(toml), "--out", str(tmp_path / "plan.json")]) == 0
    capsys.readouterr()
    plan = Plan.read(tmp_path / "plan.json")
    checkpoint = {"dir": str(tmp_path / "ckpt"), "every_steps": 6}
    planned = job_config(tmp_path, parallel={"plan": str(tmp_path / "plan.json")}, checkpoint=checkpoint)
    assert planned.plan(2) == plan  # the file's Plan, predictions included, run as it is
    same = {
        "dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "microbatches": plan.micro_batches if plan.pp > 1 else 1,
        "optimizer_level": plan.optimizer_level, "recompute": plan.recompute,
        "sequence_parallel": plan.sequence_parallel, "stages": plan.stages,
    }  # fmt: skip
    accumulation = plan.micro_batches if plan.pp == 1 else 1
    equivalent = job_config(
        tmp_path, parallel=same, train={"precision": plan.precision, "grad_accum": accumulation}
    )
    torch.testing.assert_close(_losses(dist_run, planned), _losses(dist_run, equivalent), rtol=RTOL, atol=0)
    assert saved_plan(tmp_path / "ckpt" / "step_000006") == plan


@pytest.mark.slow
def test_three_virtual_stages_from_a_plan_file_train_like_one_device(dist_run, tmp_path):
    """`[parallel]` runs each schedule's fewest virtual stages; a plan file gives any number."""
    Plan(pp=2, schedule="interleaved", virtual_stages=3, micro_batches=2).save(tmp_path / "plan.json")
    model = {"n_layers": 6}
    config = job_config(tmp_path, model=model, parallel={"plan": str(tmp_path / "plan.json")})
    assert config.parallel.virtual_stages == 3
    expected = _losses(dist_run, _one_device(tmp_path, model))
    torch.testing.assert_close(_losses(dist_run, config), expected, rtol=RTOL, atol=0)


def test_accumulated_micro_batches_of_a_plan_file_train_like_one_device(dist_run, tmp_path, one_device):
    """Without a pipeline a plan's micro-batches are accumulated (as `loom plan` prices them): 2 per step
    on each of 2 data-parallel ranks, at optimizer level 2."""
    Plan(dp=2, micro_batches=2, optimizer_level=2).save(tmp_path / "plan.json")
    config = job_config(tmp_path, parallel={"plan": str(tmp_path / "plan.json")})
    assert config.accumulation == 2 and config.cost_model(2)[1].micro_batches == 2
    torch.testing.assert_close(_losses(dist_run, config), one_device, rtol=RTOL, atol=0)


def test_auto_mode_prints_its_choice_and_trains_like_one_device(tmp_path, capfd, one_device):
    metrics = tmp_path / "metrics.jsonl"
    train = {"metrics_file": str(metrics), "log_every": 1}
    auto = job_config(tmp_path, parallel={"mode": "auto"}, train=train)
    toml = _write_toml(auto, tmp_path / "auto.toml")
    assert main(["train", str(toml)]) == 0
    out = capfd.readouterr().out
    chosen = auto.auto_plan(2).candidate
    assert "parallel.mode = 'auto': the planner's search on 2 x a100-80gb" in out and "best plan" in out
    assert f"optimizer level {chosen.plan.optimizer_level}" in out.split("running", 1)[1]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = torch.tensor([line["loss"] for line in lines if line["kind"] == "step"])
    torch.testing.assert_close(losses, one_device, rtol=RTOL, atol=0)
    assert losses[-1] < losses[0]


def test_simulate_prices_a_config_with_a_plan_file_as_the_plan_itself(tmp_path, capsys):
    plan = Plan(dp=1, pp=2, micro_batches=4, optimizer_level=1, recompute="full", precision="bf16")
    plan.save(tmp_path / "plan.json")
    config = job_config(tmp_path, parallel={"plan": str(tmp_path / "plan.json")})
    toml = _write_toml(config, tmp_path / "job.toml")
    model = tmp_path / "model.json"
    model.write_text(json.dumps(dataclasses.asdict(config.model.transformer_config())))
    assert main(["simulate", str(toml), "--json"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    batch = ["--global-batch", str(config.train.global_batch), "--seq", str(config.data.seq_len)]
    assert (
        main(
            [
                "simulate",
                "--plan",
                str(tmp_path / "plan.json"),
                "--model-config",
                str(model),
                *batch,
                "--json",
            ]
        )
        == 0
    )
    from_plan = json.loads(capsys.readouterr().out)
    assert from_config["plan"] == from_plan["plan"] and from_config["plan"]["dtype"] == "bf16"
    assert from_config["iteration_s"] == from_plan["iteration_s"] > 0
    # a config prices loom train's own run: another system's ways are not its to choose
    for flags in (["--grad-dtype", "fp32"], ["--blocking-p2p"], ["--scatter-gather-p2p"], ["--fp8-matmuls"]):
        assert main(["simulate", str(toml), *flags]) == 2
        assert f"leave out {flags[0]}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("plan", "sections", "message"),
    [
        (
            Plan(dp=4),
            {},
            "parallel.dp = 4 is out of range: dp * tp * pp * cp = 4 * 1 * 1 * 1 does not fill 2 devices",
        ),
        (
            Plan(pp=2, micro_batches=2, stages=[2, 2]),
            {},
            "parallel.stages = [2, 2] holds 4 blocks but the model has 2 layers",
        ),
        (Plan(tp=4, dp=1, pp=1), {}, "parallel.tp = 4 must divide model.n_heads = 2"),
        (Plan(dp=2), {"parallel": {"tp": 2}}, "parallel.tp = 2 (the plan: 1) disagree"),
        (
            Plan(dp=2, precision="bf16"),
            {"train": {"precision": "fp16"}},
            "train.precision = 'fp16' (the plan: 'bf16') disagree",
        ),
        (
            Plan(dp=2, precision="fp8"),
            {},
            "precision = 'fp8', which the simulator prices but loom train does not",
        ),
        (
            Plan(dp=2, strategies={"blocks.*.mlp": {"in_strategy": [[2, 1]]}}),
            {},
            "has strategies: loom train lays out",
        ),
        (Plan(dp=2, primitives_follow_inputs=True), {}, "has primitives_follow_inputs: loom train lays out"),
        (
            Plan(dp=2, compute_layouts={"blocks.*.mlp.w_up": ["None", "dp"]}),
            {},
            "has compute_layouts: loom train",
        ),
        (Plan(dp=2, input_layouts={"ids": ["None", "None"]}), {}, "has input_layouts: loom train"),
    ],
    ids=[
        "world-size",
        "layers",
        "heads",
        "explicit-key",
        "precision",
        "fp8",
        "strategies",
        "follow-inputs",
        "compute-layouts",
        "input-layouts",
    ],  # fmt: skip
)
def test_a_plan_that_does_not_fit_the_run_is_a_clear_error(tmp_path, plan, sections, message):
    plan.save(tmp_path / "plan.json")
    parallel = {"plan": str(tmp_path / "plan.json"), **sections.pop("parallel", {})}
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        job_config(tmp_path, parallel=parallel, **sections).validate(2)
    assert "parallel.plan = " in str(error.value)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"tp": 2}, "parallel.mode = 'auto' chooses parallel.tp itself; remove it"),
        ({"plan": "plan.json"}, "keep one (remove parallel.plan, or set parallel.mode = 'manual')"),
        ({"memory_limit": "lots"}, "parallel.memory_limit = 'lots' is not a size"),
        (
            {"memory_limit": "1GiB"},
            "no plan of the model fits 2 x a100-80gb under parallel.memory_limit = '1GiB'",
        ),
        ({"hardware": "tpu"}, "parallel.hardware = 'tpu': unknown hardware"),
        (
            {"mode": "manual", "memory_limit": 2**30},
            "parallel.memory_limit is the planner's: it needs parallel.mode",
        ),
    ],
)
def test_auto_mode_mistakes_name_the_key(tmp_path, parallel, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        job_config(tmp_path, parallel={"mode": "auto", **parallel}).validate(2)


def test_a_memory_limit_reads_bytes_or_a_size(tmp_path):
    for given, limit in ((2**31, 2**31), ("2GiB", 2**31), ("1.5 GB", 1_500_000_000), ("512MiB", 2**29)):
        config = job_config(tmp_path, parallel={"mode": "auto", "memory_limit": given})
        assert config.parallel.memory_limit_bytes() == limit
