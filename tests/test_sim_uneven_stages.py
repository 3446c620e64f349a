"""Uneven pipeline stages in the simulator: explicit layers per stage, Llama 3 405B's light ends (126 layers on
16 stages), the parameters and memory of each stage, and `loom simulate --stage-layers`."""

import json

import pytest

from loom.cli.main import main
from loom.cost.hardware import get_cluster
from loom.cost.plan import FieldError, ParallelPlan, light_ends
from loom.cost.transformer import TransformerConfig
from loom.plan import Plan
from loom.sim import PlanError, check_plan, simulate
from loom.sim.memory import stage_parameters

MODEL = TransformerConfig(name="t", layers=4, hidden=256, heads=4, vocab=1000)
CLUSTER = get_cluster("a100-80gb", gpus=2)


def plan(**changes) -> ParallelPlan:
    return ParallelPlan(pp=2, global_batch=8, seq=128, **changes)


def test_light_ends():
    assert light_ends(126, 16) == (7, *[8] * 14, 7)
    assert sum(light_ends(30, 4)) == 30 and light_ends(30, 4) == (7, 8, 8, 7)
    with pytest.raises(ValueError, match="127 layers on 16 stages"):
        light_ends(127, 16)


def test_equal_stage_layers_are_the_default():
    assert simulate(MODEL, plan(stage_layers=(2, 2)), CLUSTER) == simulate(MODEL, plan(), CLUSTER)


def test_an_uneven_stage_holds_its_layers_and_costs_more():
    even, uneven = plan(), plan(stage_layers=(1, 3))
    one_layer = MODEL.layer_parameters()
    assert stage_parameters(MODEL, uneven, 1)[0] - stage_parameters(MODEL, even, 1)[0] == pytest.approx(
        one_layer
    )
    assert stage_parameters(MODEL, even, 0)[0] - stage_parameters(MODEL, uneven, 0)[0] == pytest.approx(
        one_layer
    )
    slow, fast = simulate(MODEL, uneven, CLUSTER), simulate(MODEL, even, CLUSTER)
    assert slow.iteration_s > fast.iteration_s
    assert len(slow.stage_memory_gib) == 2 and slow.stage_memory_gib[1] > fast.stage_memory_gib[1]
    assert slow.memory_per_device_gib == max(slow.stage_memory_gib)


def test_stage_layer_mistakes_are_named():
    with pytest.raises(FieldError, match="one layer count per virtual stage: pp \\* interleave = 2"):
        plan(stage_layers=(1, 1, 2))
    assert "the stages hold 5 layers (2, 3), but the model has 4" in check_plan(
        MODEL, plan(stage_layers=(2, 3)), CLUSTER
    )
    with pytest.raises(PlanError, match="give the layers of each stage"):
        simulate(MODEL.__class__(name="t", layers=5, hidden=256, heads=4, vocab=1000), plan(), CLUSTER)


def test_a_plan_with_blocks_per_stage_is_priced_unevenly():
    priced = Plan(dp=1, pp=2, micro_batches=4, stages=[1, 3]).parallel_plan(global_batch=8, seq=128)
    assert priced.stage_layers == (1, 3)
    paths = Plan(dp=1, pp=2, micro_batches=4, stages=[["layers.0"], ["layers.1"]]).parallel_plan(
        global_batch=8, seq=128
    )
    assert paths.stage_layers == ()


def test_simulate_llama3_405b_on_16_uneven_stages(capsys):
    args = ["--model", "llama3-405b", "--hardware", "h100-sxm", "--gpus", "16384", "--tp", "8", "--pp", "16",
            "--global-batch", "2048", "--seq", "8192", "--optimizer-level", "1", "--recompute", "full",
            "--sequence-parallel"]  # fmt: skip
    assert main(["simulate", *args]) == 1
    assert "126 layers do not split into pp*interleave = 16 equal stages" in capsys.readouterr().err
    assert main(["simulate", *args, "--stage-layers", "light-ends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["stage_layers"] == [7, *[8] * 14, 7] and len(data["stage_memory_gib"]) == 16
    assert main(["simulate", *args, "--stage-layers", "light-ends"]) == 0
    assert "memory per pipeline stage, GiB: " in capsys.readouterr().out
    assert main(["simulate", *args, "--stage-layers", "8,x"]) == 1
    assert "give 16 layer counts separated by commas" in capsys.readouterr().err


def test_light_ends_with_as_many_stages_as_layers_plus_two_leave_the_ends_to_embedding_and_head():
    # Megatron's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split: the
    # embedding and the loss each count as a layer, so 94 layers on 96 virtual stages are 0, 1 x 94, 0
    assert light_ends(94, 96) == (0, *[1] * 94, 0)
    assert light_ends(4, 6) == (0, 1, 1, 1, 1, 0)


def test_a_stage_may_hold_only_the_embedding_or_only_the_head():
    """4 layers on pp 2 x 3 virtual stages, the ends without transformer layers: the first virtual stage's
    parameters are the embedding's, the last's the output layer's (with the final norm, and a copy of the tied
    embedding), and their passes are the embedding's and the head's alone."""
    from loom.cost.layer import piece_costs
    from loom.sim.memory import chunk_parameters
    from loom.sim.simulator import _stage_durations

    ends = ParallelPlan(pp=2, interleave=3, global_batch=8, seq=128, stage_layers=(0, 1, 1, 1, 1, 0))
    cluster = get_cluster("a100-80gb", gpus=2)
    assert check_plan(MODEL, ends, cluster) == []
    assert chunk_parameters(MODEL, ends, 0) == (MODEL.embedding_parameters(), 0)
    h, v = MODEL.hidden, MODEL.vocab
    assert chunk_parameters(MODEL, ends, 5) == (MODEL.output_parameters() + v * h, 0)  # tied: own copy
    assert chunk_parameters(MODEL, ends, 2)[0] == MODEL.layer_parameters()
    pieces = piece_costs(MODEL, ends, cluster)
    forward, backward = _stage_durations(MODEL, ends, cluster, pieces)
    assert forward[0] == sum(pieces.embed_fwd.values()) and backward[0] == sum(pieces.embed_bwd.values())
    assert forward[5] == sum(pieces.head_fwd.values()) and backward[5] == sum(pieces.head_bwd.values())
    assert forward[1:5] == [sum(pieces.layer_fwd.values())] * 4
    result = simulate(MODEL, ends, cluster)
    assert len(result.stage_memory_gib) == 2 and result.iteration_s > 0


def test_only_the_ends_may_hold_no_layer():
    with pytest.raises(FieldError, match=r"stage_layers\[1\] = 0 .*only the first virtual stage"):
        ParallelPlan(pp=2, interleave=3, global_batch=8, seq=128, stage_layers=(1, 0, 1, 1, 1, 0))
    with pytest.raises(FieldError, match=r"stage_layers\[0\] = 0 .*>= 1"):
        ParallelPlan(global_batch=8, seq=128, stage_layers=(0,))  # one stage: embedding, layers and head
    with pytest.raises(FieldError, match=r"stage_layers\[5\] = -1 .*>= 0"):
        ParallelPlan(pp=2, interleave=3, global_batch=8, seq=128, stage_layers=(1, 1, 1, 1, 1, -1))


def test_loom_simulate_prices_ends_without_layers(capsys):
    args = ["simulate", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--hardware",
            "a100-80gb", "--gpus", "2", "--pp", "2", "--interleave", "3", "--global-batch", "8", "--seq", "128"]  # fmt: skip
    assert main([*args, "--stage-layers", "0,1,1,1,1,0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["stage_layers"] == [0, 1, 1, 1, 1, 0] and len(data["stage_memory_gib"]) == 2
    assert main([*args, "--stage-layers", "light-ends", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage_memory_gib"] == data["stage_memory_gib"]
    assert main([*args, "--stage-layers", "0,1,1,1,1,0"]) == 0
    assert "memory per pipeline stage, GiB: " in capsys.readouterr().out
    assert main([*args, "--stage-layers", "1,1,0,1,1,0"]) == 1
    assert "--stage-layers[2] = 0" in capsys.readouterr().err
