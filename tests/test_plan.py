"""Tier 1: `loom.plan.Plan`, the one plain-data plan: validation, JSON, a config compiled to a Plan, the
simulator pricing a Plan and a config, and the Plan a checkpoint stores."""

from __future__ import annotations

import json

import pytest
import torch

from loom.checkpoint import save_checkpoint
from loom.checkpoint.export import saved_plan
from loom.cli.main import build_parser, main, parse_arguments
from loom.cost.hardware import get_cluster
from loom.cost.transformer import transformer_config
from loom.models.config import GPTConfig
from loom.models.gpt import GPT, Strategies
from loom.parallel.pipeline.schedule import SCHEDULES as PIPELINE_SCHEDULES
from loom.plan import SCHEDULES, FieldError, Plan
from loom.sim.simulator import simulate
from loom.train import Trainer
from loom.train.config import ParallelConfig, TrainConfig, load_config
from loom.train.job import gpt_config

DEMO = "configs/demo.toml"  # dp 2 x tp 2 on 4 workers, sequence parallel, optimizer level 1

FULL = Plan(
    dp=2, tp=2, pp=2, ep=2, schedule="interleaved", virtual_stages=2, micro_batches=4,
    stages=[["model.layers.0"], ["model.layers.1", "model.layers.2"], ["model.layers.3"], ["model.norm"]],
    optimizer_level=3, recompute="selective", recompute_modules={"model.layers.*.mlp": "full"},
    sequence_parallel=True, precision="bf16",
    strategies={
        "model.layers.*.mlp.up_proj": {"in_strategy": [[2, 1, 1]], "parameter_plan": {"weight": [2, 1]}},
        "model.layers.*.mlp.down_proj": {"in_strategy": [["dp", "None", "tp"]], "out_strategy": [[2, 1, 1]]},
    },
    parameter_layouts={"model.embed_tokens.weight": ["tp", "None"], "lm_head.weight": [["dp", "tp"], "None"]},
    primitives_follow_inputs=True, predicted_step_s=1.25, predicted_memory_bytes=3 << 30,
)  # fmt: skip


# ---- validation: each mistake names the field and the fix ----
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"dp": 0}, ["plan.dp = 0", "or -1 to fill"]),
        ({"tp": -2}, ["plan.tp = -2", "whole number >= 1"]),
        ({"optimizer_level": 4}, ["plan.optimizer_level = 4", "use 0 (none), 1 (states)"]),
        ({"recompute": "some"}, ["plan.recompute = 'some'", "use one of ('none', 'selective', 'full')"]),
        ({"schedule": "zigzag"}, ["plan.schedule = 'zigzag'", "use one of"]),
        ({"schedule": "interleaved"}, ["plan.virtual_stages = 1", "'interleaved' runs 2 or more chunks"]),
        ({"schedule": "gpipe", "virtual_stages": 2}, ["plan.virtual_stages = 2", "runs 1 chunks"]),
        ({"pp": 4, "micro_batches": 2}, ["plan.micro_batches = 2", "4 pipeline stages", "use >= 4"]),
        ({"dp": 4, "ep": 3}, ["plan.ep = 3", "divide dp = 4"]),
        ({"precision": "fp64"}, ["plan.precision = 'fp64'", "use one of"]),
        ({"stages": [1, 2]}, ["plan.stages = [1, 2]", "give 1 stages"]),
        ({"pp": 2, "micro_batches": 2, "stages": [3, 0]}, ["plan.stages", "at least 1 block"]),
        ({"recompute_modules": {"*.mlp": "half"}}, ["plan.recompute_modules['*.mlp'] = 'half'"]),
        ({"strategies": {"a b": {"in_strategy": [[1]]}}}, ["plan.strategies = ", "dotted path pattern"]),
        ({"strategies": {"*.q": {"in_stratgy": [[1]]}}}, ["in_stratgy", "did you mean 'in_strategy'"]),
        (
            {"strategies": {"*.q": {"local": True, "in_strategy": [[1]]}}},
            ["plan.strategies['*.q']", "give local alone"],
        ),
        ({"strategies": {"*.q": {"in_strategy": [[2, 0]]}}}, ["in_strategy[0] = [2, 0]", "1 or more parts"]),
        ({"parameter_layouts": {"w": ["dp", "dp"]}}, ["axis 'dp' cuts the tensor twice"]),
        ({"parameter_layouts": {"w": ["mp", "None"]}}, ["parameter_layouts['w']", "an axis of"]),
        ({"primitives_follow_inputs": "yes"}, ["plan.primitives_follow_inputs = 'yes'", "true or false"]),
        ({"predicted_step_s": -1.0}, ["plan.predicted_step_s = -1.0", "positive number"]),
        ({"predicted_memory_bytes": float("nan")}, ["plan.predicted_memory_bytes = nan"]),
    ],
)
def test_mistakes_name_the_field_and_the_fix(fields, expected):
    with pytest.raises(FieldError) as error:
        Plan(**fields)
    for text in expected:
        assert text in str(error.value)


def test_resolve_fills_dp_and_checks_the_world():
    plan = Plan(tp=2, pp=2, micro_batches=2)
    assert not plan.resolved and plan.resolve(8).dp == 2
    assert plan.resolve(8).mesh_sizes() == {"pp": 2, "dp": 2, "tp": 2}
    assert Plan(dp=4, cp=2).mesh_sizes() == {"dp": 4, "cp": 2}
    with pytest.raises(ValueError, match="does not fill 6 devices; make the product 6"):
        Plan(dp=2, tp=2).resolve(6)
    with pytest.raises(ValueError, match="call plan.resolve"):
        plan.mesh_sizes()


# ---- JSON ----
def test_json_round_trip_is_exact_and_stable(tmp_path):
    text = FULL.to_json()
    assert Plan.from_json(text) == FULL and Plan.from_json(text).to_json() == text
    assert list(json.loads(text)) == list(FULL.to_dict())  # the fields' order, every field written
    assert '"in_strategy": [[2, 1, 1]]' in text  # short lists on one line: a diff shows what changed
    assert Plan.load(FULL.save(tmp_path / "plan.json")) == FULL
    assert len({FULL, Plan.from_json(text), Plan()}) == 2  # hashable: a planner may keep plans in a set
    assert Plan(strategies={"*.q": {"in_strategy": ((2, 1),)}}) == Plan(
        strategies={"*.q": {"in_strategy": [[2, 1]]}}
    )


def test_json_mistakes_are_clear(tmp_path):
    with pytest.raises(ValueError, match="unknown plan field 'micro_batch' .*did you mean 'micro_batches'"):
        Plan.from_dict({"micro_batch": 4})
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json("{dp: 2}")
    with pytest.raises(ValueError, match="cannot be read"):
        Plan.load(tmp_path / "missing.json")


def test_one_list_of_schedule_names():
    assert tuple(PIPELINE_SCHEDULES) == SCHEDULES
    assert set(ParallelConfig.field_types()["schedule"].__args__) <= set(SCHEDULES)


# ---- a config compiles to a Plan; one model description ----
def test_config_compiles_to_a_plan():
    config = load_config(DEMO)
    assert config.plan(4) == Plan(dp=2, tp=2, sequence_parallel=True, optimizer_level=1, precision="fp32")
    piped = load_config(
        None, ["--parallel.pp=2", "--parallel.microbatches=4", "--parallel.schedule=zero_bubble"]
    )
    assert piped.plan(2) == Plan(dp=1, pp=2, micro_batches=4, schedule="zero_bubble")
    with pytest.raises(ValueError, match="parallel.optimizer_level = 5 is out of range: use 0 \\(none\\)"):
        load_config(None, ["--parallel.optimizer_level=5"])
    with pytest.raises(ValueError, match="parallel.dp = 1 is out of range: .*make the product 4"):
        load_config(DEMO, ["--parallel.dp=1"]).plan(4)


def test_a_bad_model_fails_at_config_load_not_in_the_workers():
    with pytest.raises(ValueError, match="model.dropout = 0.1 is out of range: dropout > 0 is not supported"):
        load_config(DEMO, ["--model.dropout=0.1"])
    with pytest.raises(ValueError, match="model.dropout = 0.1"):
        GPTConfig(dropout=0.1)  # the same rule, in the one class


def test_the_cost_model_sees_the_model_the_trainer_builds():
    for overrides in ([], ["--model.norm=rmsnorm", "--model.positions=rotary", "--model.mlp=swiglu",
                           "--model.n_kv_heads=2", "--model.tie_embeddings=false"]):  # fmt: skip
        config = load_config(DEMO, overrides)
        model = GPT(gpt_config(config), Strategies())
        priced = config.model.transformer_config()
        assert priced == transformer_config(config.model.gpt_config())
        assert priced.parameter_count() == sum(p.numel() for p in model.parameters())


# ---- the simulator prices a Plan and a config ----
def test_simulate_a_plan_file(tmp_path, capsys):
    path = Plan(dp=-1, tp=2, pp=2, micro_batches=8, recompute="full", precision="bf16").save(
        tmp_path / "p.json"
    )
    shape = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--seq", "1024"]
    assert main(["simulate", "--plan", str(path), *shape, "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["plan"]["dp"] == 2 and data["plan"]["recompute"] == "full"
    assert data["plan"]["global_batch"] == 16 and data["plan"]["micro_batch"] == 1  # dp * micro-batches
    assert main(["simulate", "--plan", str(path), *shape]) == 1
    assert "give --gpus" in capsys.readouterr().err
    assert main(["simulate", "--plan", str(path), *shape, "--gpus", "8", "--tp", "4"]) == 2
    assert "--plan sets the parallel degrees" in capsys.readouterr().err


def test_simulate_a_config_prices_the_run_loom_train_makes(capsys):
    assert main(["simulate", DEMO]) == 0
    out = capsys.readouterr().out
    assert "dp 2 tp 2 pp 1" in out and "global batch 32 x 32 tokens" in out and "iteration" in out
    assert main(["simulate", DEMO, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    config = load_config(DEMO)
    model, priced = config.cost_model(4)
    expected = simulate(model, priced, get_cluster("a100-80gb", gpus=4))
    assert data["plan"] == priced.to_dict() and data["iteration_s"] == expected.iteration_s
    assert priced.optimizer_level == 1 and priced.sequence_parallel and priced.dtype == "fp32"
    assert main(["simulate", DEMO, "--tp", "4"]) == 2
    assert "CONFIG.toml sets the model" in capsys.readouterr().err


def test_simulate_a_config_takes_loom_trains_overrides(capsys):
    overrides = ["--train.workers", "8", "--parallel.tp=4", "--parallel.optimizer_level", "2"]
    assert main(["simulate", DEMO, *overrides, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model, priced = load_config(DEMO, overrides).cost_model(8)
    assert data["plan"] == priced.to_dict() and (priced.dp, priced.tp, priced.optimizer_level) == (2, 4, 2)
    assert main(["simulate", DEMO, "--parallel.tpp", "4"]) == 2
    assert "did you mean 'parallel.tp'" in capsys.readouterr().err
    for command in ("simulate", "train"):  # one parser of overrides for both: 4 was taken for CONFIG.toml
        assert main([command, "--parallel.tp", "4", DEMO]) == 2
        assert "overrides go after CONFIG.toml" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt3-175b", "--parallel.tp=4"]) == 2
    assert "give CONFIG.toml first" in capsys.readouterr().err
    assert main(["checkpoint", "ls", "runs", "--parallel.tp=4"]) == 2  # only simulate takes them
    assert "unrecognized arguments: --parallel.tp=4" in capsys.readouterr().err
    args = parse_arguments(build_parser(), ["train", DEMO, "--train.steps", "3", "-v", "--parallel.tp=1"])
    assert args.verbose and args.overrides == ["--train.steps", "3", "--parallel.tp=1"]  # -v among them


# ---- checkpoints store the Plan ----
def test_checkpoint_plan_json_loads_as_a_plan(tmp_path, capsys):
    config = load_config(None, ["--parallel.optimizer_level=0", "--parallel.recompute=full"])
    model = torch.nn.Linear(4, 4)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    save_checkpoint(tmp_path, trainer, config=config)
    [step] = [path for path in tmp_path.iterdir() if path.name.startswith("step_")]
    assert saved_plan(step) == config.plan(1) == Plan(dp=1, recompute="full")
    data = json.loads((step / "plan.json").read_text())
    assert TrainConfig.from_dict(data["config"]).plan(1) == Plan.from_dict(data["plan"])
    shape = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32", "--json"]
    assert main(["simulate", "--plan", str(step / "plan.json"), *shape]) == 0  # priced as it ran
    assert json.loads(capsys.readouterr().out)["plan"]["recompute"] == "full"


@pytest.mark.parametrize(
    "own",
    [
        {"strategies": {"blocks.*.mlp": {"out_strategy": [["dp", "None"]]}}},
        {"parameter_layouts": {"head.weight": ["tp", "None"]}},
        {"compute_layouts": {"head.weight": ["None", "None"]}},
        {"input_layouts": {"x": ["None", "None"]}},
        {"primitives_follow_inputs": True},
    ],
)
def test_a_plan_with_its_own_layouts_refuses_the_megatron_prediction(own):
    """An automatic plan's layouts are not the Megatron ones the prediction assumes: refused, naming the key
    and where an automatic plan's prediction is."""
    config = transformer_config(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    with pytest.raises(ValueError, match=rf"sets {next(iter(own))}.*model.loom.predicted_collectives"):
        Plan(dp=2, tp=2, **own).predicted_collectives(config, global_batch=4, seq=16)
    assert Plan(dp=2, tp=2).predicted_collectives(config, global_batch=4, seq=16), "a Megatron plan predicts"
