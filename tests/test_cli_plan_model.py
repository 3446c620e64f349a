"""`loom plan --model MODULE:FUNCTION`: a small MLP regression, written as a module in a temporary directory,
planned at the operator level on 8 devices with and without a memory limit; the written plan applied by
`loom.parallelize(plan=...)` on 4 gloo ranks trains as one device; each bad spec's error."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
import torch
from equivalence import train_steps

from loom.cli.main import main
from loom.cost.hardware import GIB, get_cluster
from loom.plan import Plan
from loom.plan.capture import capture
from loom.plan.model_spec import build_model, with_batch
from loom.plan.problem import OPTIMIZER_COPIES
from loom.plan.space import strategy_space

MODULE = "plan_model_mlp"
WIDTH, ROWS = 16, 8
PARAMETERS = 2 * WIDTH * 4 * WIDTH + 4 * WIDTH + WIDTH  # two linear layers' weights and biases
STATES_GIB = OPTIMIZER_COPIES * 4 * PARAMETERS / GIB  # fp32 weights, gradients and Adam's moments, whole
RESERVED_GIB = get_cluster(
    "h100-sxm"
).device.reserved_gib  # counted in every plan's memory, as loom simulate does

SOURCE = f"""
import torch
from torch import nn


class Regression(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, y):
        return ((self.mlp(x) - y) ** 2).mean()


def build():
    return Regression({WIDTH}), (torch.randn({ROWS}, {WIDTH}), torch.randn({ROWS}, {WIDTH}))


def only_model():
    return Regression({WIDTH})


def no_inputs_tuple():
    return Regression({WIDTH}), 3


def needs_an_argument(width):
    return Regression(width), (torch.randn({ROWS}, width),)


def branches():
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y.sum() if y.sum() > 0 else -y.sum()

    return Branching(), (torch.randn(2, 4),)


not_a_function = 3
"""


@pytest.fixture
def builder(tmp_path, monkeypatch):
    """The MLP's module in a temporary directory, which is the current directory (as a user runs it)."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield tmp_path
    sys.modules.pop(MODULE, None)


def plan_json(capsys, *options: str) -> dict:
    argv = ["plan", "--model", f"{MODULE}:build", "--hardware", "h100-sxm", "--gpus", "8", "--json", *options]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_a_python_model_is_planned_on_every_mesh_and_a_memory_limit_cuts_its_weights(builder, capsys):
    free = plan_json(capsys)
    meshes = [free["best"]["mesh"]] + [entry["mesh"] for entry in free["runners_up"]]
    assert sorted(map(json.dumps, meshes)) == sorted(
        map(json.dumps, [{"dp": 8}, {"dp": 4, "tp": 2}, {"dp": 2, "tp": 4}, {"tp": 8}])
    )
    steps = [free["best"]["step_s"]] + [entry["step_s"] for entry in free["runners_up"]]
    assert steps == sorted(steps) and all(
        re.fullmatch(r"slower by [\d.]+%|as fast, .* more memory per device|as good \(a tie\)", e["why_lost"])
        for e in free["runners_up"]
    ), free["runners_up"]
    assert (
        free["best"]["memory_gib"] > RESERVED_GIB + STATES_GIB / 2
    )  # no limit: more than the cut plan below
    assert free["best"]["mfu"] > 0 and free["considered"] == free["simulated"] == 4

    limit = RESERVED_GIB + STATES_GIB / 2
    tight = plan_json(capsys, "--memory-limit", repr(limit))
    best = tight["best"]
    assert best["memory_gib"] <= limit < free["best"]["memory_gib"]
    assert best["step_s"] >= free["best"]["step_s"]
    layouts = best["plan"]["parameter_layouts"]
    assert {"mlp.0.weight", "mlp.2.weight"} <= set(layouts), layouts  # both weights cut
    assert Plan.from_dict(best["plan"]).predicted_memory_bytes <= (limit - RESERVED_GIB) * GIB


def test_the_report_names_the_layouts_the_runners_up_and_the_meshes_that_cannot_run(builder, capsys):
    argv = ["plan", "--model", f"{MODULE}:build", "--gpus", "8", "--global-batch", "12", "--top", "2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for expected in ("best plan dp=", "parameter layouts", "runners-up", "slower by", "not searched"):
        assert expected in text, text
    assert "dp=8 tp=1: input x has 12 rows, which do not split over dp=8" in text
    over = ["plan", "--model", f"{MODULE}:build", "--gpus", "8", "--memory-limit"]
    assert main([*over, repr(RESERVED_GIB + 1e-9)]) == 1  # a byte beyond the device's reserved memory
    err = capsys.readouterr().err
    assert "no layout fits" in err and "raise --memory-limit or --gpus" in err, err
    assert main([*over, "1"]) == 1  # under the reserved memory itself
    assert "leaves nothing beyond the device's reserved" in capsys.readouterr().err


def one_device_and_plans(directory: str, plans: list[Plan]) -> list[tuple]:
    """The MLP trained 3 SGD steps on one device and under each of `plans` (`_one_device_and_plan`)."""
    sys.path.insert(0, directory)
    try:
        from plan_model_mlp import Regression

        return [_one_device_and_plan(Regression, plan) for plan in plans]
    finally:  # the workers live on for other tests: leave their path and modules as found
        sys.path.remove(directory)
        sys.modules.pop(MODULE, None)


def _one_device_and_plan(model_class, plan: Plan) -> tuple:
    """Both runs' losses, first-step gradients and parameters after the last step (each data-parallel
    replica of the plan reading its rows), and whether this rank holds a strict part of every weight."""
    import copy

    import loom

    torch.manual_seed(0)
    reference = model_class(WIDTH)
    model = copy.deepcopy(reference)
    data = [(torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)) for _ in range(3)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    expected = train_steps(reference, sgd(reference), data, lambda batch: reference(*batch))
    mesh = loom.init(plan.mesh_sizes())  # dp kept at size 1: the axis the batch is split along
    rows = lambda t: t.chunk(mesh.dp_size)[mesh.dp_rank()]
    loom.parallelize(model, plan=plan)
    actual = train_steps(model, sgd(model), data, lambda batch: model(rows(batch[0]), rows(batch[1])))
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    return expected, actual, all(p.to_local().numel() < p.numel() for p in weights)


@pytest.mark.slow  # 4 gloo ranks, two plans: 10-33 s on the 2 shared cores
def test_the_written_plan_and_a_runner_up_train_as_one_device(builder, dist_run, capsys):
    """The best plan on 4 devices under half the weights' states (written with --out), and the dp 2 x tp 2
    runner-up (from --json): each gives one device's losses, gradients and parameters after SGD."""
    out = builder / "plan.json"
    argv = [
        "plan",
        "--model",
        f"{MODULE}:build",
        "--gpus",
        "4",
        "--memory-limit",
        repr(RESERVED_GIB + STATES_GIB / 2),
    ]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    runner_up = next(e for e in found["runners_up"] if e["mesh"] == {"dp": 2, "tp": 2})
    plans = [Plan.load(out), Plan.from_dict(runner_up["plan"])]
    for plan in plans:
        assert plan.parameter_layouts and plan.predicted_memory_bytes <= STATES_GIB / 2 * GIB
    for results in dist_run(4, one_device_and_plans, str(builder), plans):
        for plan, (expected, actual, cut) in zip(plans, results, strict=True):
            assert cut, plan.parameter_layouts
            torch.testing.assert_close(
                torch.tensor(actual[0]), torch.tensor(expected[0]), rtol=1e-5, atol=1e-6
            )
            for name in expected[1]:
                torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(actual[2][name], expected[2][name], rtol=1e-4, atol=1e-6)


def test_meshes_share_the_rules_answers_per_axis_size(builder):
    """The model is built on the meta device with its batch resized; the space of dp 2 x tp 4 made with
    the answers dp 4 x tp 2 cached is the one made afresh."""
    built = build_model(f"{MODULE}:build", global_batch=4)
    assert all(p.is_meta for p in built.model.parameters())  # built on the meta device: no memory
    assert [tuple(x.shape) for x in built.args] == [(4, WIDTH), (4, WIDTH)]  # dim 0 resized to the batch
    graph = capture(built.model, built.args)
    asked: dict = {}
    strategy_space(graph, {"dp": 4, "tp": 2}, cache=asked)
    known = len(asked)
    shared = strategy_space(graph, {"dp": 2, "tp": 4}, cache=asked)
    assert len(asked) == known  # nothing new was asked
    fresh = strategy_space(graph, {"dp": 2, "tp": 4})
    assert {n: s.candidates for n, s in shared.ops.items()} == {n: s.candidates for n, s in fresh.ops.items()}


@pytest.mark.parametrize(
    "spec,message",
    [
        ("plan_model_mlp", "MODULE:FUNCTION"),  # no colon: not a preset either
        ("plan_model_mlp:", "a Python model is given as MODULE:FUNCTION"),
        ("no_such_module_h3:build", "no module 'no_such_module_h3' on sys.path or in the current directory"),
        ("plan_model_mlp:missing", "has no attribute 'missing'; its public callables are"),
        ("plan_model_mlp:not_a_function", "'not_a_function' is a int, not a function"),
        ("plan_model_mlp:needs_an_argument", "raised TypeError"),
        ("plan_model_mlp:only_model", "returned a Regression; it must return (model, example_args)"),
        ("plan_model_mlp:no_inputs_tuple", "returned a tuple of 2 (Regression, int)"),
        ("plan_model_mlp:branches", "cannot capture Branching"),
    ],
)
def test_a_bad_spec_names_itself_and_the_fix(builder, capsys, spec, message):
    assert main(["plan", "--model", spec, "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if spec.endswith(":branches"):  # the operator and the fallbacks
        assert "Tensor.__bool__" in err and "semi_auto" in err and "data_parallel" in err, err
    if ":" in spec:
        assert repr(spec) in err, err


def test_options_a_python_model_does_not_take(builder, capsys):
    spec = f"{MODULE}:build"
    assert main(["plan", "--model", spec]) == 2
    assert "--gpus is missing" in capsys.readouterr().err
    assert main(["plan", "--model", spec, "--gpus", "8", "--seq", "128"]) == 2
    assert "--seq does not apply" in capsys.readouterr().err
    assert main(["plan", "configs/demo.toml", "--model", spec, "--gpus", "8"]) == 2
    assert "give one model" in capsys.readouterr().err


def test_the_global_batch_resizes_nested_inputs_and_keeps_what_needs_a_gradient():
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    args, kwargs = with_batch(({"x": x, "n": 3},), {"pair": [torch.zeros(ROWS, dtype=torch.long)]}, 32)
    assert args[0]["x"].shape == (32, WIDTH) and args[0]["x"].requires_grad and args[0]["n"] == 3
    assert kwargs["pair"][0].shape == (32,) and kwargs["pair"][0].dtype == torch.long
    with pytest.raises(ValueError, match="--global-batch 32: no tensor input has a dim 0"):
        with_batch((torch.tensor(1.0),), {}, 32)


HF_SOURCE = """
import torch
import transformers


def build():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    ids = torch.zeros(8, 16, dtype=torch.long)
    return transformers.GPT2LMHeadModel(config), (ids,), {"labels": ids}
"""


@pytest.mark.slow  # two captures and searches of a Hugging Face model: make test-all
def test_a_hugging_face_model_built_from_its_config_is_planned_and_cut_under_a_limit(
    tmp_path, monkeypatch, capsys
):
    """Hugging Face GPT-2, built from a config and unedited, through `--model MODULE:FUNCTION` on 4 devices:
    a plan without a limit, and under three quarters of its whole states a plan that cuts parameters and
    fits."""
    pytest.importorskip("transformers")
    (tmp_path / "hf_gpt2_plan.py").write_text(HF_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "hf_gpt2_plan", raising=False)
    argv = ["plan", "--model", "hf_gpt2_plan:build", "--hardware", "h100-sxm", "--gpus", "4", "--json"]
    assert main(argv) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["best"] and free["considered"] == free["simulated"] == 3 and not free["infeasible"]
    parameters = 110336  # GPT-2 of this config: embeddings, 2 blocks, final norm (the head tied)
    limit = RESERVED_GIB + 0.73 * OPTIMIZER_COPIES * 4 * parameters / GIB
    assert main([*argv, "--memory-limit", repr(limit)]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["memory_gib"] <= limit < free["best"]["memory_gib"]
    assert best["plan"]["parameter_layouts"], best["plan"]
    sys.modules.pop("hf_gpt2_plan", None)
