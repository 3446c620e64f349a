"""torchtitan's op-level selective checkpointing ("torchtitan_op"), priced for its published runs: which
matmuls it saves, the FLOPs, time and collectives it re-runs and the activations it keeps, to the byte."""

from __future__ import annotations

import pytest

from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import matmul_time, memory_time
from loom.cost.hardware import get_cluster
from loom.cost.layer import piece_costs
from loom.cost.memory import layer_activation_bytes
from loom.cost.plan import PRICED_RECOMPUTE, RECOMPUTE, TORCHTITAN_LAYER_EVERY, FieldError, ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.plan import Plan
from loom.plan.outer import search_plans
from loom.sim.simulator import simulate

# a Llama layer in small: GQA (4 query heads of 16, 2 key/value heads), SwiGLU, no biases, no dropout
TINY = TransformerConfig(
    layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=100, gated_mlp=True, norm="rmsnorm",
    biases=False, dropout=False, tied_embeddings=False,
)  # fmt: skip
PLAN = ParallelPlan(micro_batch=2, global_batch=2, seq=8, recompute="torchtitan_op", flash_attention=True)
CLUSTER = get_cluster("a100-80gb", gpus=2)


def test_every_second_matmul_of_the_forward_is_recomputed():
    # forward order wq, wk, wv, wo, w1, w3, w2: the 1st, 3rd, 5th and 7th mm saved
    saved, recomputed = TINY.op_sac_matmuls()
    assert saved == [("wq", 64, 64), ("wv", 64, 32), ("w1", 64, 128), ("w2", 128, 64)]
    assert recomputed == [("wk", 64, 32), ("wo", 64, 64), ("w3", 64, 128)]
    # a plain MLP: wq, wk, wv, wo, w1, w2
    assert [n for n, _, _ in TINY.replace(gated_mlp=False).op_sac_matmuls()[1]] == ["wk", "wo", "w2"]


@pytest.mark.parametrize("change", [{"biases": True}, {"experts": 4, "top_k": 2}, {"fused_qkv": True}])
def test_other_layers_are_refused_with_the_policies_to_use(change):
    with pytest.raises(ValueError, match="none, selective or full"):
        TINY.replace(**change).op_sac_matmuls()


def test_recompute_flops_are_the_unsaved_matmuls():
    # 2 FLOPs per multiply-add: wk 64x32, wo 64x64, w3 64x128 per token; 2 layers, 2 x 8 tokens
    assert TINY.recompute_flops(2, 8, "torchtitan_op") == 2 * (64 * 32 + 64 * 64 + 64 * 128) * 2 * 16
    assert TINY.hardware_flops(2, 8, "torchtitan_op") > TINY.hardware_flops(2, 8, "selective")


def test_activations_kept_are_the_input_and_the_saved_outputs():
    # 16 tokens in bf16: input 64, wq 64, wv 32, w1 128, w2 64 wide; attention output 64 wide and an fp32
    # log-sum-exp per token and head
    one = layer_activation_bytes(TINY, 8, 2, recompute="torchtitan_op", flash_attention=True)
    assert one == 2 * 16 * 64 + 2 * 16 * (64 + 32 + 128 + 64) + 2 * 16 * 64 + 4 * 16 * 4 == 13568
    # tp 2 with sequence parallelism: the input and the two reduce-scatter outputs cut by sequence, the
    # column-parallel outputs cut by features, w2's output a partial sum over the whole width
    two = layer_activation_bytes(
        TINY, 8, 2, 2, recompute="torchtitan_op", sequence_parallel=True, flash_attention=True
    )
    assert two == 2 * 8 * 64 + 2 * 16 * (32 + 16 + 64 + 64) + 2 * 8 * 64 + 4 * 8 * 4 + 2 * 2 * 8 * 64 == 9856
    full = layer_activation_bytes(TINY, 8, 2, recompute="full", flash_attention=True)
    none = layer_activation_bytes(TINY, 8, 2, flash_attention=True)
    assert full < one < none


def test_recompute_time_is_the_unsaved_matmuls_and_the_elementwise_kernels():
    dev = CLUSTER.device
    recompute = piece_costs(TINY, PLAN, CLUSTER).layer_recompute
    gemms = matmul_time(dev, 16, 64, 32) + matmul_time(dev, 16, 64, 64) + matmul_time(dev, 16, 64, 128)
    assert recompute["matmul"] == pytest.approx(gemms, rel=1e-12)
    # bf16: one residual add (3 x 16 x 64 x 2 bytes), two norms (2 x 2 x 16 x 64 x 2), SwiGLU (3 x 2 x 16 x 128)
    assert 3 * 2 * 16 * 64 + 2 * 2 * 16 * 64 * 2 + 3 * 2 * 16 * 128 == 26624
    assert recompute["elementwise"] == pytest.approx(memory_time(dev, 26624, kernels=5), rel=1e-12)
    assert recompute["tp_comm"] == 0.0


def test_sequence_parallel_gathers_are_rerun_and_its_scatters_saved():
    plan = PLAN.replace(tp=2, sequence_parallel=True)
    dev, recompute = CLUSTER.device, piece_costs(TINY, plan, CLUSTER).layer_recompute
    # wk and w3 cut by output features, wo by input features
    gemms = matmul_time(dev, 16, 64, 16) + matmul_time(dev, 16, 32, 64) + matmul_time(dev, 16, 64, 64)
    assert recompute["matmul"] == pytest.approx(gemms, rel=1e-12)
    gather = collective_time("all_gather", 2 * 16 * 64, group_span(2, 1, CLUSTER.gpus_per_node), CLUSTER)
    assert recompute["tp_comm"] == pytest.approx(2 * gather, rel=1e-12)


def test_the_simulator_prices_it_between_no_and_full_recomputation():
    base = ParallelPlan(global_batch=1, seq=4096, flash_attention=True)
    llama = TINY.replace(layers=8, hidden=2048, heads=16, kv_heads=4, ffn_hidden=5632, vocab=32000)
    cluster = get_cluster("a100-80gb", gpus=1)
    runs = {r: simulate(llama, base.replace(recompute=r), cluster) for r in ("none", "torchtitan_op", "full")}
    assert runs["none"].iteration_s < runs["torchtitan_op"].iteration_s < runs["full"].iteration_s
    memory = {r: run.memory_per_device_gib for r, run in runs.items()}
    assert memory["none"] > memory["torchtitan_op"] > memory["full"]

    # beside the 8 layers' kept tensors, the backward rebuilds one layer's at a time, as under full recomputation
    def beyond_layers(recompute: str) -> float:
        kept = layer_activation_bytes(llama, 4096, 1, recompute=recompute, flash_attention=True)
        return runs[recompute].memory_breakdown_gib["activations"] * 2**30 - 8 * kept

    assert beyond_layers("torchtitan_op") == pytest.approx(beyond_layers("full"), rel=1e-9)


def test_loom_neither_runs_nor_plans_it():
    assert "torchtitan_op" in PRICED_RECOMPUTE and "torchtitan_op" not in RECOMPUTE
    with pytest.raises(FieldError, match="recompute"):
        Plan(recompute="torchtitan_op")
    with pytest.raises(FieldError, match="search_plans.recompute"):
        search_plans(TINY, get_cluster("h100-sxm"), 8, 16, 8, recompute=("torchtitan_op",))


def test_a_model_it_cannot_price_is_an_impossible_plan_naming_the_flag():
    from loom.sim.presets import get_model
    from loom.sim.simulator import PlanError

    plan = ParallelPlan(dp=8, global_batch=8, seq=2048, recompute="torchtitan_op", flash_attention=True)
    with pytest.raises(PlanError, match="--recompute torchtitan_op: 'gpt3-175b' is not torchtitan's"):
        simulate(get_model("gpt3-175b"), plan, get_cluster("h100-sxm", 8))


@pytest.mark.parametrize("change", [{"flash_attention": False}, {"cp": 2}, {"fp8_matmuls": True}])
def test_it_is_priced_only_as_torchtitan_ran_it(change):
    with pytest.raises(FieldError, match="flash_attention, cp = 1 and no fp8_matmuls"):
        PLAN.replace(dp=2, global_batch=4, **change)


def test_layer_level_checkpointing_is_every_second_layer_recomputed_whole():
    # torchtitan's selective_ac_option = "2": one layer in two checkpointed (torch's non-reentrant
    # checkpoint, which stops before w2), the other keeping everything; priced per layer as their mean
    assert TORCHTITAN_LAYER_EVERY == 2
    layer, full = (
        piece_costs(TINY, PLAN.replace(recompute=r), CLUSTER).layer_recompute
        for r in ("torchtitan_layer", "full")
    )
    assert layer == pytest.approx({k: v / 2 for k, v in full.items()}, rel=1e-12)
    assert TINY.recompute_flops(2, 8, "torchtitan_layer", skip_mlp_out=True) == pytest.approx(
        TINY.recompute_flops(2, 8, "full", skip_mlp_out=True) / 2, rel=1e-12
    )
    kept = {
        r: layer_activation_bytes(TINY, 8, 2, recompute=r, flash_attention=True)
        for r in ("torchtitan_layer", "full", "none")
    }
    assert kept["torchtitan_layer"] == (kept["full"] + kept["none"]) / 2
    assert "torchtitan_layer" not in RECOMPUTE


def test_torchtitan_s_layer_level_rows_are_priced():
    from loom.sim.validation.published import published_cases

    cases, skipped = published_cases()
    layer = [c.label for c in cases if c.plan.recompute == "torchtitan_layer"]
    assert layer == ["llama3-8b selective layer bf16", "llama2-13b selective layer bf16"]
    assert not [s for s in skipped if "selective layer" in s.label]
