"""Tier 1: the cost model's terms that the published runs called for, checked with exact numbers: fused
attention's roofline, how gradients are accumulated and reduced, experts' own tensor parallelism, and the
BLOOM cluster's fabric."""

from __future__ import annotations

import dataclasses

import pytest

from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import fused_attention_time
from loom.cost.hardware import Device, Link, get_cluster
from loom.cost.layer import gemm_shapes
from loom.cost.plan import FieldError, ParallelPlan
from loom.cost.traffic import shards_as_rows
from loom.cost.transformer import TransformerConfig
from loom.cost.zero3 import (
    UnitBytes,
    UnitCopyBytes,
    copy_in_out_bytes,
    flat_copy_bytes,
    gradient_predivide_factor,
    layer_unit_bytes,
    unit_copy_bytes,
)
from loom.sim import simulate
from loom.sim.memory import chunk_parameters, stage_parameters
from loom.sim.validation.published import jean_zay

# round numbers: 100 TFLOP/s, half of it for GEMMs, half of that for fused attention, 1 TB/s, no knee
DEVICE = Device(
    name="round", peak_flops={"bf16": 100e12}, memory_gib=80, memory_bandwidth=1e12, matmul_efficiency=0.5,
    matmul_knee=0.0, attention_efficiency=0.5, memory_efficiency=1.0,
)  # fmt: skip
# one layer: attention 64*192 + 64*64 + 256 biases = 16640, MLP 2*64*256 + 320 = 33088, two LayerNorms 256
GPT = TransformerConfig(layers=4, hidden=64, heads=4, vocab=128, dropout=False)


def _free_links():
    """8 of `DEVICE` on links without cost: only memory passes and compute separate two plans."""
    ideal = Link(name="ideal", bandwidth=1e30, latency_s=0.0)
    return dataclasses.replace(get_cluster("a100-80gb", gpus=8), device=DEVICE, intra=ideal, inter=ideal)


LAYER = 16640 + 33088 + 256


def test_fused_attention_counts_flops_and_tiles_not_scores():
    # 4 * 1024 * 64 * 1024 * 8 heads, half the blocks (causal), at 100e12 * 0.5 * 0.5 FLOP/s
    seconds = fused_attention_time(DEVICE, 1024, 64, 1024, batch=8, share=0.5)
    assert seconds == pytest.approx(4 * 1024 * 64 * 1024 * 8 * 0.5 / 25e12, rel=1e-12)
    # its speed does not depend on the head size: twice the head size, exactly twice the time
    assert fused_attention_time(DEVICE, 1024, 128, 1024, batch=8, share=0.5) == pytest.approx(2 * seconds)
    # memory-bound only when the peak is huge: then Q, K, V and O tiles, 2 * (q + k) * d * batch * 2 bytes
    fast = dataclasses.replace(DEVICE, peak_flops={"bf16": 1e30})
    assert fused_attention_time(fast, 1024, 64, 1024, batch=8) == pytest.approx(2 * 2048 * 64 * 8 * 2 / 1e12)


def test_fused_attention_knee_applies_to_queries_and_keys_only():
    knee = dataclasses.replace(DEVICE, matmul_knee=32.0)
    expected = 4 * 96 * 64 * 160 / (25e12 * (96 / 128) * (160 / 192))
    assert fused_attention_time(knee, 96, 64, 160) == pytest.approx(expected, rel=1e-12)


def test_grad_fields_are_validated():
    base = {"dp": 2, "global_batch": 2, "seq": 8}
    with pytest.raises(FieldError, match="grad_reduce.*keeps whole gradients"):
        ParallelPlan(**base, grad_reduce="reduce_scatter")
    with pytest.raises(FieldError, match="grad_reduce.*shards gradients"):
        ParallelPlan(**base, optimizer_level=2, grad_reduce="all_reduce")
    with pytest.raises(FieldError, match="grad_dtype"):
        ParallelPlan(**base, grad_dtype="fp8")
    with pytest.raises(FieldError, match="expert_tp"):
        ParallelPlan(**base, tp=4, expert_tp=3)
    plan = ParallelPlan(**base, optimizer_level=1, grad_reduce="all_reduce", grad_dtype="fp32")
    assert plan.grad_collective == "all_reduce" and plan.grad_precision == "fp32"
    assert ParallelPlan(**base, optimizer_level=1).grad_collective == "reduce_scatter"


def test_chunk_parameters_add_up_to_the_stage():
    plan = ParallelPlan(pp=2, interleave=2, global_batch=4, seq=8)
    # chunk 0: a layer and the embedding; chunk 3: a layer, the final norm and the tied embedding's copy
    assert chunk_parameters(GPT, plan, 0) == (LAYER + 128 * 64, 0)
    assert chunk_parameters(GPT, plan, 3) == (LAYER + 128 + 128 * 64, 0)
    assert stage_parameters(GPT, plan, 1)[0] == chunk_parameters(GPT, plan, 1)[0] + LAYER + 128 + 128 * 64


def test_separate_fp32_accumulation_is_a_memory_pass_per_micro_batch():
    cluster = get_cluster("a100-80gb", gpus=1)
    cluster = dataclasses.replace(cluster, device=DEVICE)
    fused = ParallelPlan(micro_batch=1, global_batch=4, seq=64, grad_dtype="fp32", master_weights="optimizer")
    separate = fused.replace(grad_accumulation="separate")
    a, b = simulate(GPT, fused, cluster), simulate(GPT, separate, cluster)
    # 4 layers, the embedding and the final norm; read bf16 gradients, read and write fp32: 10 bytes each
    params = 4 * LAYER + 128 * 64 + 128
    assert b.breakdown["grad_accumulation"] == pytest.approx(4 * params * 10 / 1e12, rel=1e-12)
    assert a.breakdown["grad_accumulation"] == 0.0
    assert b.iteration_s - a.iteration_s == pytest.approx(4 * params * 10 / 1e12, rel=1e-9)
    assert sum(b.breakdown.values()) == pytest.approx(b.iteration_s, rel=1e-9)
    # the fp32 buffer and the bf16 gradients live side by side: 2 more bytes per parameter than fp32 alone
    extra = b.memory_breakdown_gib["model_states"] - a.memory_breakdown_gib["model_states"]
    assert extra * 1024**3 == pytest.approx(2 * params)


def test_fsdp_gradient_predivide_factor():
    # the largest power of two f with f * f <= world that divides it, as torch computes it
    assert [gradient_predivide_factor(n) for n in (1, 2, 4, 6, 8, 64, 512)] == [1, 2, 2, 4, 4, 8, 32]


def test_fsdp1_flat_copy_bytes_per_unit_and_micro_batch():
    plan = ParallelPlan(
        dp=8, global_batch=32, seq=64, optimizer_level=3, grad_dtype="fp32", grad_accumulation="flat_copy"
    )
    # 1000 parameters over 8 ranks, 4 micro-batches: the split backward's copy reads and writes bf16 (4 B);
    # cast bf16 -> fp32 6 B, pre-divide by 4 in fp32 8 B, then on the 125-parameter shard the post-divide
    # by 2 (8 B) and the accumulation 12 B in three micro-batches of four
    flat = flat_copy_bytes(1000, 8, plan)
    assert (flat.compute, flat.reduce, flat.reduce_kernels) == (4000, 6000 + 8000 + 1000 + 1125, 4)
    # reduced in bf16 over 2 ranks in one micro-batch: no cast, pre-divide by 2 only, nothing after
    plan = ParallelPlan(dp=2, global_batch=2, seq=64, optimizer_level=3, grad_accumulation="flat_copy")
    assert flat_copy_bytes(1000, 2, plan) == type(flat)(compute=4000, reduce=4000, reduce_kernels=1)
    with pytest.raises(FieldError, match="grad_accumulation.*optimizer level 3"):
        ParallelPlan(dp=2, global_batch=2, seq=64, optimizer_level=1, grad_accumulation="flat_copy")


def test_fsdp1_flat_copy_is_a_memory_pass_on_the_compute_stream():
    # links without cost: only the gradients' memory passes separate the two plans
    cluster = _free_links()
    fused = ParallelPlan(dp=8, global_batch=32, seq=64, optimizer_level=3, grad_dtype="fp32")
    a, b = simulate(GPT, fused, cluster), simulate(GPT, fused.replace(grad_accumulation="flat_copy"), cluster)
    # every unit (embedding, 4 layers, final norm) copies its whole bf16 gradient in each of 4 micro-batches
    params = 4 * LAYER + 128 * 64 + 128
    copy = 4 * params * 4 / 1e12
    assert b.breakdown["grad_accumulation"] == pytest.approx(copy, rel=1e-12)
    assert a.breakdown["grad_accumulation"] == 0.0
    # the cast and pre-divide run beside the compute; what they do not hide delays the reduce-scatters
    assert a.breakdown["fsdp_exposed_comm"] == pytest.approx(0.0, abs=1e-15)
    exposed = b.breakdown["fsdp_exposed_comm"]
    # the fused plan is loom's runtime, which gathers fp32 units and casts them under autocast; FSDP casts
    # each shard before gathering it
    casts = a.breakdown["weight_cast"]
    assert casts > 0 and "weight_cast" not in b.breakdown
    assert b.iteration_s - a.iteration_s == pytest.approx(copy + exposed - casts, rel=1e-9)
    # at most every unit's preparation, 14 B per parameter and the shard's 8 + 9 B per 8 parameters
    assert 0 < exposed <= 4 * (params * 14 + params / 8 * (8 + 9)) / 1e12 * (1 + 1e-9)
    assert sum(b.breakdown.values()) == pytest.approx(b.iteration_s, rel=1e-9)


def test_fsdp2_copy_in_out_bytes_per_unit_and_micro_batch():
    plan = ParallelPlan(
        dp=8, global_batch=32, seq=64, optimizer_level=3, grad_dtype="fp32", grad_accumulation="copy_in_out"
    )
    # 1000 parameters over 8 ranks, 4 micro-batches, bf16 parameters reduced in fp32 (torchtitan): each
    # all-gather's copy-out reads and writes bf16 (4 B); the copy-in reads bf16 and writes fp32 (6 B), no
    # divide (NCCL's average); on the 125-parameter fp32 shard only the accumulation, 12 B in three of four
    assert copy_in_out_bytes(1000, 8, plan) == UnitCopyBytes(
        gather=4000, compute=6000, reduce=1125, reduce_kernels=1
    )
    assert unit_copy_bytes(1000, 8, plan) == copy_in_out_bytes(1000, 8, plan)
    # fp16 reduced in fp16: pre-divide by 4 (4 B) waited for by the compute stream; on the shard the
    # post-divide by 2 (4 B), the cast to the fp32 parameter (6 B) and the accumulation
    fp16 = plan.replace(dtype="fp16", grad_dtype="")
    assert copy_in_out_bytes(1000, 8, fp16) == UnitCopyBytes(
        gather=4000, compute=4000 + 4000, reduce=500 + 750 + 1125, reduce_kernels=3
    )
    # bf16 reduced in bf16 over 2 ranks in one micro-batch: the copy-in, and the cast of the 500-parameter shard
    plan = ParallelPlan(dp=2, global_batch=2, seq=64, optimizer_level=3, grad_accumulation="copy_in_out")
    assert copy_in_out_bytes(1000, 2, plan) == UnitCopyBytes(
        gather=4000, compute=4000, reduce=3000, reduce_kernels=1
    )
    # the fused path copies nothing
    assert unit_copy_bytes(1000, 2, plan.replace(grad_accumulation="fused")) == UnitCopyBytes(
        compute=0, reduce=0, reduce_kernels=0
    )
    with pytest.raises(FieldError, match="grad_accumulation.*optimizer level 3"):
        ParallelPlan(dp=2, global_batch=2, seq=64, optimizer_level=1, grad_accumulation="copy_in_out")


def test_fsdp2_copies_are_memory_passes_on_the_compute_stream():
    # links without cost: only the copies separate the two plans
    cluster = _free_links()
    fused = ParallelPlan(dp=8, global_batch=8, seq=64, optimizer_level=3, grad_dtype="fp32")
    a, b = (
        simulate(GPT, fused, cluster),
        simulate(GPT, fused.replace(grad_accumulation="copy_in_out"), cluster),
    )
    # every unit (embedding, 4 layers, final norm) in one micro-batch: its gradients copied into fp32 (6 B)
    # once, its parameters copied out of the bf16 all-gather (4 B) after the forward's and the backward's
    params = 4 * LAYER + 128 * 64 + 128
    assert b.breakdown["grad_accumulation"] == pytest.approx(6 * params / 1e12, rel=1e-12)
    assert b.breakdown["param_copy_out"] == pytest.approx(2 * 4 * params / 1e12, rel=1e-12)
    assert a.breakdown["grad_accumulation"] == a.breakdown["param_copy_out"] == 0.0
    # one micro-batch reduced in fp32 into fp32 parameters: nothing runs beside the reduce-scatters
    assert b.breakdown["fsdp_exposed_comm"] == pytest.approx(0.0, abs=1e-15)
    casts = a.breakdown["weight_cast"]  # loom's runtime casts its fp32 units under autocast (above)
    assert b.iteration_s - a.iteration_s == pytest.approx(14 * params / 1e12 - casts, rel=1e-9)
    assert sum(b.breakdown.values()) == pytest.approx(b.iteration_s, rel=1e-9)


def test_fsdp_shard_grad_op_runs_unit_by_unit_without_the_backward_gathers():
    # compute and memory passes free, links of bandwidth only: every time left is a collective, and a
    # collective's time is linear in its bytes, so the units' gathers sum to one gather of the whole model
    fast = dataclasses.replace(DEVICE, peak_flops={"bf16": 1e30}, memory_bandwidth=1e30)
    link = Link(name="slow", bandwidth=1e9, latency_s=0.0)
    cluster = dataclasses.replace(get_cluster("a100-80gb", gpus=8), device=fast, intra=link, inter=link)
    level2 = ParallelPlan(dp=8, global_batch=8, seq=64, optimizer_level=2, grad_dtype="fp32")
    step_end = simulate(
        GPT, level2, cluster
    )  # loom's level 2: reduce after the backward, gather after the step
    sgo = simulate(GPT, level2.replace(grad_accumulation="flat_copy"), cluster)  # FSDP1's SHARD_GRAD_OP
    full = simulate(GPT, level2.replace(optimizer_level=3, grad_accumulation="flat_copy"), cluster)
    span = group_span(8, 1, cluster.gpus_per_node)
    params = 4 * LAYER + 128 * 64 + 128
    gather = collective_time("all_gather", 2 * params, span, cluster)  # FSDP gathers bf16 casts
    gather_fp32 = collective_time("all_gather", 4 * params, span, cluster)  # loom its fp32 parameters
    scatter = collective_time("reduce_scatter", 4 * params, span, cluster)
    assert gather > 0 and step_end.breakdown["dp_comm"] > 0 and sgo.breakdown["dp_comm"] == 0.0
    # one micro-batch: the same collectives, gathered before each unit's forward and reduce-scattered
    # after each unit's backward instead of at the step's end; FULL_SHARD gathers again for the backward
    assert step_end.iteration_s == pytest.approx(gather_fp32 + scatter, rel=1e-9)
    assert sgo.iteration_s == pytest.approx(gather + scatter, rel=1e-9)
    assert full.iteration_s == pytest.approx(2 * gather + scatter, rel=1e-9)
    # four micro-batches: both FSDP strategies gather and reduce-scatter in every one of them
    four = level2.replace(global_batch=32, grad_accumulation="flat_copy")
    assert simulate(GPT, four, cluster).iteration_s == pytest.approx(4 * (gather + scatter), rel=1e-9)
    assert simulate(GPT, level2.replace(global_batch=32), cluster).iteration_s == pytest.approx(
        gather_fp32 + scatter, rel=1e-9
    )


def test_fp32_all_reduce_of_the_whole_gradient():
    cluster = get_cluster("a100-80gb", gpus=8)
    link = cluster.intra
    plan = ParallelPlan(
        dp=8, micro_batch=1, global_batch=8, seq=64, optimizer_level=1, overlap_grad_sync=False
    )
    params = 4 * LAYER + 128 * 64 + 128

    def dp_comm(**changes) -> float:
        return simulate(GPT, plan.replace(**changes), cluster).breakdown["dp_comm"]

    # ring all-reduce over 8 GPUs of one node: bus factor 2 * 7/8, 6 latency steps (tree-like log2 n, x2)
    all_reduce_fp32 = 6 * link.latency_s + 4 * params * 2 * 7 / 8 / link.bus_bandwidth
    reduce_scatter_bf16 = 3 * link.latency_s + 2 * params * 7 / 8 / link.bus_bandwidth
    reduce_scatter_fp32 = 3 * link.latency_s + 4 * params * 7 / 8 / link.bus_bandwidth
    assert dp_comm(grad_dtype="fp32", grad_reduce="all_reduce") == pytest.approx(all_reduce_fp32, rel=1e-12)
    # 16-bit parameters with the master weights in the optimizer reduce their 16-bit gradients; loom's
    # runtime, whose fp32 parameters are the master weights, reduces fp32 ones
    assert dp_comm(master_weights="optimizer") == pytest.approx(reduce_scatter_bf16, rel=1e-12)
    assert dp_comm() == pytest.approx(reduce_scatter_fp32, rel=1e-12)


def test_zero3_reduce_scatter_in_the_gradient_precision():
    assert UnitBytes(dense=10.0, expert=4.0).scaled(2.0) == UnitBytes(dense=20.0, expert=8.0)
    plan = ParallelPlan(dp=8, global_batch=8, seq=64, optimizer_level=3)
    cluster = get_cluster("a100-80gb", gpus=8)
    bf16, fp32 = simulate(GPT, plan, cluster), simulate(GPT, plan.replace(grad_dtype="fp32"), cluster)
    assert fp32.iteration_s >= bf16.iteration_s  # twice the bytes reduce-scattered, same gathers


def test_expert_tensor_parallelism_folds_tp_and_dp():
    moe = TransformerConfig(layers=2, hidden=64, heads=4, vocab=128, experts=8, top_k=2, dropout=False)
    plan = ParallelPlan(
        dp=4, tp=2, ep=8, expert_tp=1, micro_batch=1, global_batch=4, seq=64, sequence_parallel=True
    )  # ep 8 spans the 2 x 4 ranks of the stage: one expert per rank, whole
    assert (plan.etp, plan.edp) == (1, 1)
    # each rank routes its 64 / 2 tokens, top-2: 64 rows to its one expert, whose 256 are not cut
    assert {(64, 64, 256), (64, 256, 64)} <= set(gemm_shapes(moe, plan))
    # with expert_tp = tp (loom's own layout) ep must divide dp
    with pytest.raises(ValueError, match="ep=8 must divide dp=4"):
        plan.replace(expert_tp=0)
    # the expert unit's gathered bytes: all 8 experts' MLPs (2 * 64 * 256 + 320 each) over etp * ep = 8
    sharded = plan.replace(dp=8, ep=8, global_batch=8, optimizer_level=3, master_weights="optimizer")
    assert layer_unit_bytes(moe, sharded).expert == 2 * 8 * 33088 / 8
    assert group_span(8, sharded.etp, 8).nodes == 1  # the ep group: 8 consecutive ranks, one node


def test_jean_zay_has_four_omni_path_links_per_node():
    cluster = jean_zay()
    assert cluster.inter.bandwidth == 4 * 12.5e9 / 8 == 6.25e9  # bytes/s per GPU
    assert cluster.device.name == "a100-80gb" and cluster.gpus_per_node == 8


@pytest.mark.parametrize(("level", "accumulation"), [(3, "fused"), (2, "flat_copy")])
def test_sharded_experts_sync_over_their_own_data_parallel_group_without_a_dense_one(level, accumulation):
    """dp 1, tp 8, ep 2 with experts whole (edp 4): the experts' units are gathered and reduce-scattered over
    edp even though the dense parameters have no data-parallel group."""
    from loom.sim.presets import get_model

    plan = ParallelPlan(dp=1, tp=8, ep=2, expert_tp=1, optimizer_level=level, grad_accumulation=accumulation,
                        global_batch=16, seq=4096)  # fmt: skip
    assert plan.edp == 4
    result = simulate(get_model("mixtral-8x7b"), plan, get_cluster("h100-sxm", 8))
    assert result.breakdown["fsdp_exposed_comm"] > 0


def test_fsdp_copies_under_context_parallelism_are_sized_over_dp_times_cp():
    # with cp the parameters are sharded over dp x cp: at dp 1, cp 2 each unit's fp16 gradients are reduced
    # over 2 ranks, so FSDP2 pre-divides them (4 B) beside the copy-in (4 B), where a shard group of dp = 1
    # alone would reduce nothing and pre-divide nothing
    cluster = dataclasses.replace(_free_links(), gpus=2)
    plan = ParallelPlan(
        dp=1, cp=2, global_batch=1, seq=64, optimizer_level=3, dtype="fp16", grad_accumulation="copy_in_out"
    )
    params = 4 * LAYER + 128 * 64 + 128  # every unit (embedding, 4 layers, final norm) in one micro-batch
    rows = shards_as_rows(plan)
    assert copy_in_out_bytes(params, 2, rows).compute == 8 * params
    assert copy_in_out_bytes(params, 1, plan).compute == 4 * params
    priced = simulate(GPT, plan, cluster).breakdown["grad_accumulation"]
    assert priced == pytest.approx(8 * params / 1e12, rel=1e-12)


def test_autocast_casts_the_weights_as_loom_runs_it():
    """loom's runtime keeps fp32 parameters and computes under autocast: every forward of a micro-batch casts
    the matmul weights (biases too; norms and the embedding lookup are not cast; the tied table is, for the
    output projection) and keeps the 16-bit copies for the backward, which casts each weight gradient back
    and, from the second micro-batch on, adds it into the fp32 gradient."""
    from loom.cost.hardware import GIB
    from loom.cost.layer import piece_costs

    cluster, launch = _free_links(), DEVICE.kernel_overhead_s
    plan = ParallelPlan(dp=8, global_batch=32, seq=64)  # 4 micro-batches of one sequence
    weights, head = LAYER - 256, 128 * 64  # a layer's matmul weights and biases; the tied table
    pieces = piece_costs(GPT, plan, cluster)
    assert pieces.layer_fwd["weight_cast"] == pytest.approx(weights * (4 + 2) / 1e12 + 6 * launch, rel=1e-12)
    backward = weights * (2 + 4 + 12 * 3 / 4) / 1e12 + 12 * launch
    assert pieces.layer_bwd["weight_cast"] == pytest.approx(backward, rel=1e-12)
    assert pieces.head_fwd["weight_cast"] == pytest.approx(head * 6 / 1e12 + launch, rel=1e-12)
    result = simulate(GPT, plan, cluster)
    assert result.memory_breakdown_gib["weight_casts"] * GIB == pytest.approx(2 * (4 * weights + head))
    per_micro_batch = 4 * (pieces.layer_fwd["weight_cast"] + backward)
    per_micro_batch += pieces.head_fwd["weight_cast"] + pieces.head_bwd["weight_cast"]
    assert result.breakdown["weight_cast"] == pytest.approx(4 * per_micro_batch, rel=1e-12)
    # a whole-layer recomputation runs in an autocast region of its own: it casts again
    full = piece_costs(GPT, plan.replace(recompute="full"), cluster)
    assert full.layer_recompute["weight_cast"] == pieces.layer_fwd["weight_cast"]
    # a pipeline's schedule is one autocast region: one cast a step (an eighth per micro-batch of 8), and
    # the cache serves the recomputation; each rank holds one copy of its own weights
    piped = plan.replace(dp=4, pp=2, recompute="full")
    staged = piece_costs(GPT, piped, cluster)
    assert staged.layer_fwd["weight_cast"] == pytest.approx((weights * 6 / 1e12 + 6 * launch) / 8, rel=1e-12)
    assert "weight_cast" not in staged.layer_recompute
    fullest = simulate(GPT, piped, cluster).memory_breakdown_gib  # the last rank: its layers and the table
    assert fullest["weight_casts"] * GIB == pytest.approx(2 * (2 * weights + head))
    # Megatron-LM's 16-bit parameters, FSDP's casts of its shards and fp32 training cast nothing here
    fp32 = dataclasses.replace(cluster, device=dataclasses.replace(DEVICE, peak_flops={"fp32": 50e12}))
    for other, on in (
        (plan.replace(master_weights="optimizer"), cluster),
        (plan.replace(optimizer_level=3, grad_accumulation="copy_in_out"), cluster),
        (plan.replace(dtype="fp32"), fp32),
    ):
        assert "weight_cast" not in piece_costs(GPT, other, on).layer_fwd
        assert simulate(GPT, other, on).memory_breakdown_gib["weight_casts"] == 0.0
