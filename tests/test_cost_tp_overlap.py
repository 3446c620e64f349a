"""Tensor-parallel communication overlapped with the GEMMs (`ParallelPlan.overlap_tp_comm`, Megatron-Core's
--tp-comm-overlap on Transformer Engine's userbuffers): the chunked schedules' times, what a layer leaves
exposed, to the number, and the plans it cannot apply to."""

from __future__ import annotations

import pytest

from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import matmul_time
from loom.cost.hardware import get_cluster
from loom.cost.layer import (
    UB_PIPELINE_SPLITS,
    overlapped_tp_time,
    piece_costs,
    pipelined_scatter_time,
    ring_exchange_time,
)
from loom.cost.plan import FieldError, ParallelPlan
from loom.cost.transformer import TransformerConfig

# a Llama layer: GQA, SwiGLU, no biases, no dropout; wide enough that its GEMMs are not all at the knee
LLAMA = TransformerConfig(
    layers=4, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000, gated_mlp=True, norm="rmsnorm",
    biases=False, dropout=False, tied_embeddings=False,
)  # fmt: skip
PLAN = ParallelPlan(
    tp=4, micro_batch=1, global_batch=1, seq=8192, sequence_parallel=True, flash_attention=True
)
CLUSTER = get_cluster("h100-sxm", gpus=8)


def test_ring_exchange_hides_the_gather_but_the_last_chunk_of_gemm():
    # tp 4: 4 GEMM steps of 1 ms beside 3 hops; the gather's 3 hops of 0.5 ms hide, of 2 ms they bind
    assert ring_exchange_time(4e-3, 1.5e-3, 4) == pytest.approx(4e-3)
    assert ring_exchange_time(4e-3, 6e-3, 4) == pytest.approx(3 * 2e-3 + 1e-3)
    # tp 2: the rank's own half beside the one hop, then the received half
    assert ring_exchange_time(2e-3, 3e-3, 2) == pytest.approx(3e-3 + 1e-3)


def test_pipelined_scatter_leaves_the_first_gemm_and_the_last_scatter_chunk():
    assert UB_PIPELINE_SPLITS == 4  # Transformer Engine's default for its "pipeline" method
    # 4 chunks: 1 ms of GEMM each, 0.25 ms of scatter each (hidden but the last), then 3 ms each (binding)
    assert pipelined_scatter_time(4e-3, 1e-3, 4) == pytest.approx(1e-3 + 3 * 1e-3 + 0.25e-3)
    assert pipelined_scatter_time(4e-3, 12e-3, 4) == pytest.approx(1e-3 + 3 * 3e-3 + 3e-3)


def test_a_block_forward_rings_and_pipelines_backward_rings_and_runs_bulk():
    column, row, gather, scatter = 3e-3, 1e-3, 1.2e-3, 2e-3
    forward = overlapped_tp_time(column, row, gather, scatter, 4, "forward")
    assert forward == pytest.approx((3 * max(0.75e-3, 0.4e-3) + 0.75e-3) + (0.25e-3 + 3 * 0.5e-3 + 0.5e-3))
    backward = overlapped_tp_time(column, row, gather, scatter, 4, "backward")
    # the output gradient's gather rings with the row-parallel input gradient, the input gradient's
    # reduce-scatter runs whole beside the column-parallel weight gradient
    assert backward == pytest.approx((3 * 0.4e-3 + 0.25e-3) + max(3e-3, 2e-3))


def _gemms(plan: ParallelPlan) -> tuple[float, float, float, float]:
    """The layer's qkv, output projection, MLP-in and MLP-out GEMMs on one rank, as `piece_costs` prices."""
    h, t, tokens = LLAMA.hidden, plan.tp, plan.seq * plan.micro_batch
    q, kv, f = LLAMA.heads * LLAMA.head_dim, LLAMA.kv * LLAMA.head_dim, LLAMA.ffn
    dev = CLUSTER.device
    return (
        matmul_time(dev, tokens, h, (q + 2 * kv) / t),
        matmul_time(dev, tokens, q / t, h),
        matmul_time(dev, tokens, h, 2 * f / t),
        matmul_time(dev, tokens, f / t, h),
    )


def test_a_layer_prices_its_sequence_parallel_pairs_overlapped_and_nothing_else_changes():
    plain, overlapped = (
        piece_costs(LLAMA, PLAN, CLUSTER),
        piece_costs(LLAMA, PLAN.replace(overlap_tp_comm=True), CLUSTER),
    )
    span = group_span(4, 1, CLUSTER.gpus_per_node)
    stream = 2 * 8192 * 4096
    gather, scatter = (collective_time(k, stream, span, CLUSTER) for k in ("all_gather", "reduce_scatter"))
    # without overlap: 2 gathers and 2 reduce-scatters of the stream in each pass, one after the other
    assert plain.layer_fwd["tp_comm"] == pytest.approx(2 * (gather + scatter))
    assert plain.layer_bwd["tp_comm"] == pytest.approx(2 * (gather + scatter))
    qkv, proj, fc1, fc2 = _gemms(PLAN)
    exposed_fwd = sum(
        ring_exchange_time(column, gather, 4) + pipelined_scatter_time(row, scatter, 4) - column - row
        for column, row in ((qkv, proj), (fc1, fc2))
    )
    exposed_bwd = sum(
        ring_exchange_time(row, gather, 4) + max(column, scatter) - column - row
        for column, row in ((qkv, proj), (fc1, fc2))
    )
    assert overlapped.layer_fwd["tp_comm"] == pytest.approx(exposed_fwd, rel=1e-12)
    assert overlapped.layer_bwd["tp_comm"] == pytest.approx(exposed_bwd, rel=1e-12)
    assert 0 < overlapped.layer_fwd["tp_comm"] < plain.layer_fwd["tp_comm"]
    assert 0 < overlapped.layer_bwd["tp_comm"] < plain.layer_bwd["tp_comm"]
    # full recomputation re-runs the forward as it ran: overlapped too
    full = piece_costs(LLAMA, PLAN.replace(overlap_tp_comm=True, recompute="full"), CLUSTER)
    assert full.layer_recompute["tp_comm"] == overlapped.layer_fwd["tp_comm"]
    # the GEMMs, the embedding's and the head's collectives are priced as before
    assert overlapped.layer_fwd["matmul"] == plain.layer_fwd["matmul"]
    assert (overlapped.embed_fwd, overlapped.head_bwd) == (plain.embed_fwd, plain.head_bwd)


def test_a_mixtures_experts_are_not_overlapped():
    """Transformer Engine's grouped linears (a mixture's experts) take no userbuffers: only the attention's
    pair is overlapped, the MLP's gather and reduce-scatter stay exposed."""
    moe = LLAMA.replace(experts=8, top_k=2)
    plan = PLAN.replace(dp=8, ep=8, global_batch=8, overlap_tp_comm=True)
    cluster = get_cluster("h100-sxm", gpus=32)
    plain = piece_costs(moe, plan.replace(overlap_tp_comm=False), cluster).layer_fwd["tp_comm"]
    span = group_span(4, 1, cluster.gpus_per_node)
    stream = 2 * 8192 * 4096
    gather, scatter = (collective_time(k, stream, span, cluster) for k in ("all_gather", "reduce_scatter"))
    qkv, proj = _gemms(plan)[:2]
    attention = ring_exchange_time(qkv, gather, 4) + pipelined_scatter_time(proj, scatter, 4) - qkv - proj
    expected = plain - (gather + scatter) + attention
    assert piece_costs(moe, plan, cluster).layer_fwd["tp_comm"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("change", [{"sequence_parallel": False}, {"tp": 1}])
def test_without_sequence_parallelism_over_tp_it_is_refused(change):
    with pytest.raises(FieldError, match="ParallelPlan.overlap_tp_comm .*set sequence_parallel with tp > 1"):
        PLAN.replace(overlap_tp_comm=True, **change)


def test_a_tp_group_across_nodes_is_refused():
    plan = PLAN.replace(tp=16, overlap_tp_comm=True)
    with pytest.raises(ValueError, match="the tp group must fit in a node .*tp=16, 8 GPUs per node"):
        piece_costs(LLAMA, plan, get_cluster("h100-sxm", gpus=16))
