"""ZeRO-3 / FSDP: per-layer communication volumes and the event-level overlap of all-gathers with compute."""

import pytest

from loom.cost.collectives import collective_time, group_span
from loom.cost.hardware import get_cluster
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.cost.zero3 import embedding_unit_bytes, head_unit_bytes, layer_unit_bytes
from loom.sim import simulate
from loom.sim.overlap import sharded_pass

MODEL = TransformerConfig(layers=2, hidden=64, heads=4, vocab=100, biases=False, dropout=False)


def test_layer_volumes_per_device():
    plan = ParallelPlan(dp=4, tp=2, global_batch=8, seq=16, optimizer_level=3, master_weights="optimizer")
    # attention 4*64*64 + MLP 2*64*256 split over tp=2, plus two LayerNorms (2*64 each) replicated, bf16
    assert layer_unit_bytes(MODEL, plan).dense == 2 * ((4 * 64 * 64 + 2 * 64 * 256) / 2 + 2 * 128) == 49664
    # loom's runtime gathers its fp32 parameters, the master weights, as they are
    assert layer_unit_bytes(MODEL, plan.replace(master_weights="parameters")).dense == 2 * 49664
    assert layer_unit_bytes(MODEL, plan).expert == 0
    assert embedding_unit_bytes(MODEL, plan).dense == 2 * 100 * 64 / 2 == 6400
    assert head_unit_bytes(MODEL, plan).dense == 2 * 128  # tied head on one stage: only the final norm


def test_expert_volumes_go_to_the_expert_group():
    moe = MODEL.replace(experts=8, top_k=2)
    plan = ParallelPlan(
        dp=4, tp=2, ep=4, global_batch=8, seq=16, optimizer_level=3, master_weights="optimizer"
    )
    unit = layer_unit_bytes(moe, plan)
    assert unit.expert == 2 * 8 * (2 * 64 * 256) / (2 * 4) == 65536
    assert unit.dense == 2 * ((4 * 64 * 64 + 64 * 8) / 2 + 2 * 128) == 17408  # attention and router


def test_all_gather_exposed_when_communication_exceeds_compute():
    # three layers of 1 s compute, each gathering for 2 s, prefetched one layer ahead
    run = sharded_pass([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    computes = [(s, e) for kind, _, s, e in run.intervals if kind == "compute"]
    assert computes == [(2.0, 3.0), (4.0, 5.0), (6.0, 7.0)]  # each layer waits for its gather
    assert run.end == 7.0 and run.exposed == 4.0


def test_all_gather_hidden_when_compute_is_longer():
    run = sharded_pass([3.0, 3.0, 3.0], [1.0, 1.0, 1.0])
    assert run.end == 10.0 and run.exposed == 1.0  # only the first gather has nothing to hide behind


def test_backward_reduce_scatters_share_the_stream():
    # gather 0 (0-2), compute 0 (2-3), gather 1 issued at 2 (2-4), scatter 0 (4-5), compute 1 (4-5), scatter 1
    run = sharded_pass([1.0, 1.0], [2.0, 2.0], [1.0, 1.0])
    assert [(k, u, s, e) for k, u, s, e in run.intervals if k == "reduce_scatter"] == [
        ("reduce_scatter", 0, 4.0, 5.0),
        ("reduce_scatter", 1, 5.0, 6.0),
    ]
    assert run.end == 6.0 and run.exposed == 4.0


def test_simulated_zero3_pays_the_exposed_gathers():
    """Across nodes a small model's all-gathers outrun its compute: level 3 is slower than level 1."""
    model = TransformerConfig(layers=4, hidden=1024, heads=16, vocab=32000, biases=False, dropout=False)
    cluster = get_cluster("a100-80gb", gpus=64)
    plan = ParallelPlan(dp=64, micro_batch=1, global_batch=64, seq=512, flash_attention=True)
    zero1, zero3 = (simulate(model, plan.replace(optimizer_level=k), cluster) for k in (1, 3))
    layer = layer_unit_bytes(model, plan.replace(optimizer_level=3)).dense
    gather = collective_time("all_gather", layer, group_span(64, 1, 8), cluster)
    assert gather > 0 and zero3.iteration_s > zero1.iteration_s


def test_all_to_all_across_nodes_goes_through_each_member_nic():
    cluster = get_cluster("h100-sxm", gpus=16)
    span = group_span(16, 1, 8)  # two nodes of 8
    expected = 4 * cluster.inter.latency_s + 1e9 * (16 - 8) / 16 / cluster.inter.bus_bandwidth
    assert collective_time("all_to_all", 1e9, span, cluster) == pytest.approx(expected, rel=1e-12)


def test_breakdown_names_the_exposed_gathers():
    model = TransformerConfig(layers=4, hidden=1024, heads=16, vocab=32000, biases=False, dropout=False)
    cluster = get_cluster("a100-80gb", gpus=64)
    plan = ParallelPlan(dp=64, global_batch=64, seq=512, flash_attention=True, optimizer_level=3)
    result = simulate(model, plan, cluster)
    parts = result.breakdown
    assert parts["fsdp_exposed_comm"] > 0
    assert sum(parts.values()) == pytest.approx(result.iteration_s, rel=1e-9)


def test_reduce_scatter_waits_for_its_prepared_gradients():
    # gather 0 (0-2), compute 0 (2-3), gather 1 (2-4); unit 0's gradients prepared 3-3.5 on their own
    # stream, its scatter waits for the communication stream (4-5); unit 1 computes 4-5, is prepared 5-8
    # and scattered 8-9: a long preparation shows at the pass's end
    run = sharded_pass([1.0, 1.0], [2.0, 2.0], [1.0, 1.0], prepare=[0.5, 3.0])
    assert [(k, u, s, e) for k, u, s, e in run.intervals if k in ("prepare", "reduce_scatter")] == [
        ("prepare", 0, 3.0, 3.5),
        ("reduce_scatter", 0, 4.0, 5.0),
        ("prepare", 1, 5.0, 8.0),
        ("reduce_scatter", 1, 8.0, 9.0),
    ]
    assert run.end == 9.0
    # a long scatter of unit 0 (4-7) holds the post-backward stream it was issued from: unit 1 computes
    # 4-5 but is prepared only 7-10 (not 5-8), then scattered 10-11
    run = sharded_pass([1.0, 1.0], [2.0, 2.0], [3.0, 1.0], prepare=[0.5, 3.0])
    assert [(k, u, s, e) for k, u, s, e in run.intervals if k in ("prepare", "reduce_scatter")] == [
        ("prepare", 0, 3.0, 3.5),
        ("reduce_scatter", 0, 4.0, 7.0),
        ("prepare", 1, 7.0, 10.0),
        ("reduce_scatter", 1, 10.0, 11.0),
    ]
    with pytest.raises(ValueError, match="prepare needs scatter"):
        sharded_pass([1.0], [1.0], prepare=[1.0])


def test_a_pass_without_gathers_waits_on_no_earlier_scatter():
    # units kept gathered from the forward (level 2 unit by unit): computes 0-1, 1-2, 2-3; the long scatter of
    # unit 0 (1-6) delays only the later scatters (6-6.1, 6.1-6.2), never a compute
    run = sharded_pass([1.0, 1.0, 1.0], None, [5.0, 0.1, 0.1])
    assert [(k, u, s, e) for k, u, s, e in run.intervals if k == "compute"] == [
        ("compute", 0, 0.0, 1.0), ("compute", 1, 1.0, 2.0), ("compute", 2, 2.0, 3.0),
    ]  # fmt: skip
    assert run.end == pytest.approx(6.2)
    assert sharded_pass([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [5.0, 0.1, 0.1]).end == pytest.approx(
        7.1
    )  # queued gathers
