"""Tier 1: TOML configs into validated dataclasses; command-line overrides; error messages."""

import json

import pytest

from loom.plan import Plan
from loom.train.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    TrainingConfig,
    load_config,
    parse_overrides,
)

SAMPLE = """
[model]
d_model = 64
n_heads = 4
n_kv_heads = 2
norm = "rmsnorm"
positions = "rotary"
mlp = "swiglu"

[data]
kind = "arithmetic"
seq_len = 48

[parallel]
dp = 2
tp = 2

[train]
steps = 200
global_batch = 16
lr = 1
betas = [0.9, 0.99]
clip_grad_norm = 0.5

[checkpoint]
dir = "runs/ckpt"
every_steps = 50
"""


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(SAMPLE)
    return path


def test_defaults_are_valid_and_consistent():
    cfg = load_config(None)
    assert cfg == TrainConfig()
    assert cfg.model.kv_heads == 4 and cfg.model.ffn_dim == 512 and cfg.model.head_dim == 32
    assert cfg.data.kind == "arithmetic" and cfg.parallel.dp == -1 and cfg.train.workers == 1
    assert cfg.train.betas == (0.9, 0.95) and cfg.train.loss_scale_init == 65536.0
    assert cfg.checkpoint.dir is None and cfg.checkpoint.keep_last >= 1


def test_file_and_overrides(sample):
    cfg = load_config(
        sample,
        ["--train.steps", "100", "--parallel.tp=1", "--train.betas=0.8,0.9", "--train.clip_grad_norm", "none"]
        + ["--parallel.sequence_parallel", "true", "--model.d_ff=null", "--checkpoint.async_save=1"]
        + ["--train.lr", "1e-3", "--data.max_operand", "20", "--parallel.recompute", "none"],
    )
    assert cfg.model.n_kv_heads == 2 and cfg.model.norm == "rmsnorm" and cfg.data.seq_len == 48
    assert cfg.train.steps == 100 and cfg.parallel.tp == 1 and cfg.parallel.dp == 2
    assert cfg.train.betas == (0.8, 0.9) and cfg.train.clip_grad_norm is None
    assert cfg.parallel.sequence_parallel is True and cfg.checkpoint.async_save is True
    assert cfg.model.d_ff is None and cfg.train.lr == 1e-3 and cfg.data.max_operand == 20
    assert cfg.parallel.recompute == "none"  # a choice named "none" stays a string
    assert isinstance(load_config(sample).train.lr, float)  # TOML `lr = 1` widened to a float


def test_round_trip_through_plain_data(sample):
    cfg = load_config(sample)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["train"]["betas"] == [0.9, 0.99]
    assert TrainConfig.from_dict(data) == cfg
    text = cfg.describe()
    assert text.splitlines()[0].startswith("model") and "n_kv_heads=2" in text and "every_steps=50" in text


def test_unknown_names_suggest_the_closest(sample):
    with pytest.raises(
        ValueError, match=r"unknown key 'train\.stpes'.*did you mean 'train\.steps'.*train\.lr"
    ):
        load_config(sample, ["--train.stpes", "10"])
    with pytest.raises(ValueError, match=r"unknown section 'trian'.*did you mean 'train'.*model, data"):
        load_config(None, ["--trian.steps=10"])
    bad = sample.parent / "bad.toml"
    bad.write_text("[model]\nd_modle = 64\n")
    with pytest.raises(
        ValueError, match=r"unknown key 'model\.d_modle' in .*bad\.toml \(did you mean 'model\.d_model'"
    ):
        load_config(bad)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.steps=ten", "train.steps = 'ten' is not an integer"),
        ("--train.steps=0", r"train.steps = 0 is out of range: use a value >= 1"),
        (
            "--model.norm=batchnorm",
            r"model.norm = 'batchnorm' is not allowed; use one of \('layernorm', 'rmsnorm'\)",
        ),
        ("--model.tie_embeddings=maybe", "model.tie_embeddings = 'maybe' is not true or false"),
        ("--model.dropout=1.0", r"model.dropout = 1.0 is out of range: use a probability in \[0, 1\)"),
        ("--model.n_kv_heads=3", "model.n_kv_heads = 3 is out of range: it must divide model.n_heads = 4"),
        (
            "--model.d_model=30",
            "model.d_model = 30 is out of range: it must be divisible by model.n_heads = 4",
        ),
        ("--train.betas=0.9", "train.betas = '0.9': expected 2 comma-separated numbers"),
        ("--train.betas=0.9,1.5", r"train.betas = \(0.9, 1.5\) is out of range"),
        ("--parallel.optimizer_level=4", "parallel.optimizer_level = 4 is out of range"),
        ("--parallel.dp=0", "parallel.dp = 0 is out of range: use a size >= 1, or -1"),
        ("--train.min_lr=1", "train.min_lr = 1.0 is out of range: it must not exceed train.lr"),
        ("--data.kind=tokens", "data.kind = 'tokens' needs data.path"),
        ("--checkpoint.every_steps=5", "checkpoint.dir is not; set dir"),
        ("--data.seq_len=128", "data.seq_len = 128 exceeds model.max_seq_len = 64"),
        ("--parallel.tp=3", "parallel.tp = 3 must divide model.n_heads = 4; choose tp in"),
        ("--train.steps", "has no value"),
        ("--steps=3", "must name section.key"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_toml_types_are_enforced(tmp_path):
    path = tmp_path / "typed.toml"
    path.write_text('[train]\nsteps = "100"\n')
    with pytest.raises(ValueError, match="train.steps = '100' is str; expected an integer"):
        load_config(path)
    path.write_text("[parallel]\ntp = true\n")
    with pytest.raises(ValueError, match="parallel.tp = True is bool; expected an integer"):
        load_config(path)
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_sections_validate_when_built_in_python():
    with pytest.raises(ValueError, match="model.vocab_size = 0"):
        ModelConfig(vocab_size=0)
    with pytest.raises(ValueError, match="checkpoint.keep_last = 0"):
        CheckpointConfig(keep_last=0)
    assert DataConfig(kind="text", path="a.txt").path == "a.txt"
    assert TrainingConfig(clip_grad_norm=None).clip_grad_norm is None


def test_validate_with_world_size():
    cfg = TrainConfig(parallel=ParallelConfig(tp=2), train=TrainingConfig(global_batch=12, grad_accum=2))
    assert cfg.validate(world_size=6) is cfg
    assert cfg.parallel.dp_size(6) == 3 and cfg.parallel.mesh_sizes(6) == {"dp": 3, "tp": 2}
    with pytest.raises(ValueError, match="global_batch = 12 is not divisible by dp \\* grad_accum = 4 \\* 2"):
        cfg.validate(world_size=8)
    with pytest.raises(ValueError, match="does not fill 5 devices"):
        cfg.validate(world_size=5)
    piped = TrainConfig(parallel=ParallelConfig(pp=2, microbatches=3), train=TrainingConfig(global_batch=8))
    with pytest.raises(ValueError, match="not divisible by parallel.microbatches = 3"):
        piped.validate(world_size=2)
    assert ParallelConfig(pp=2, tp=2, microbatches=2).mesh_sizes(8) == {"pp": 2, "dp": 2, "tp": 2}


def test_parse_overrides_types():
    assert parse_overrides(
        ["--model.n_kv_heads", "None", "train.eval_every=0", "--checkpoint.every_minutes=2"]
    ) == {
        "model": {"n_kv_heads": None},
        "train": {"eval_every": 0},
        "checkpoint": {"every_minutes": 2.0},
    }


def test_sections_must_be_section_objects():
    with pytest.raises(ValueError, match="TrainConfig.train must be a TrainingConfig, got dict"):
        TrainConfig(train={"steps": 3})


# ---- a key is given when the table holds it, even at its default's value ------------------------------------


def test_a_plan_file_refuses_explicit_keys_at_their_default(tmp_path):
    Plan(dp=1, tp=2, precision="bf16").save(tmp_path / "plan.json")
    plan = f'[parallel]\nplan = "{tmp_path / "plan.json"}"\n'
    (tmp_path / "tp.toml").write_text(plan + "tp = 1\n")
    with pytest.raises(ValueError, match=r"parallel\.tp = 1 \(the plan: 2\) disagree"):
        load_config(tmp_path / "tp.toml")
    (tmp_path / "precision.toml").write_text(plan + '[train]\nprecision = "fp32"\n')
    with pytest.raises(ValueError, match=r"train\.precision = 'fp32' \(the plan: 'bf16'\) disagree"):
        load_config(tmp_path / "precision.toml")
    with pytest.raises(ValueError, match=r"parallel\.tp = 1 \(the plan: 2\) disagree"):
        load_config(None, [f"--parallel.plan={tmp_path / 'plan.json'}", "--parallel.tp=1"])
    same = load_config(tmp_path / "tp.toml", ["--parallel.tp=2", "--train.precision=bf16"])  # agreeing
    assert (same.parallel.tp, same.train.precision) == (2, "bf16")


def test_auto_mode_refuses_an_explicit_key_at_its_default():
    with pytest.raises(ValueError, match=r"chooses parallel\.optimizer_level itself; remove it"):
        TrainConfig.from_dict({"parallel": {"mode": "auto", "optimizer_level": 0}})


def test_a_sync_key_written_at_its_default_for_a_sync_that_does_not_read_it_is_an_error():
    with pytest.raises(ValueError, match=r"parallel\.sync_every = 50 is read only with parallel\.sync = "):
        TrainConfig.from_dict({"parallel": {"sync": "every_step", "sync_every": 50}})
    with pytest.raises(ValueError, match=r"parallel\.mix = 0\.5 is read only with parallel\.sync = 'diloco'"):
        load_config(None, ["--parallel.sync=local_sgd", "--parallel.mix=0.5"])
    assert (
        TrainConfig.from_dict({"parallel": {"sync": "local_sgd", "sync_every": 50}}).parallel.sync_every == 50
    )


def test_to_dict_reads_back_after_the_planner_or_a_plan_file_filled_the_sizes(tmp_path):
    data = {"parallel": {"mode": "auto"}, "train": {"workers": 2}}
    auto = TrainConfig.from_dict(data).validate(2)
    again = TrainConfig.from_dict(json.loads(json.dumps(auto.to_dict())))  # as a checkpoint's plan.json
    assert again == TrainConfig.from_dict(data) and again.validate(2).plan(2) == auto.plan(2)
    Plan(dp=1, tp=2, precision="bf16").save(tmp_path / "plan.json")
    planned = TrainConfig.from_dict({"parallel": {"plan": str(tmp_path / "plan.json")}})
    again = TrainConfig.from_dict(json.loads(json.dumps(planned.to_dict())))
    assert again == planned and again.plan(2) == planned.plan(2)
    assert (again.parallel.tp, again.train.precision) == (2, "bf16")
    assert "tp=2" in planned.describe()  # the summary shows the values the run uses
