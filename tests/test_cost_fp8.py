"""Tier 1: the casts Transformer Engine's fp8 current scaling runs around each fp8 GEMM, checked with exact
numbers (`loom.cost.compute.fp8_quantize_bytes`, `loom.cost.layer.fp8_cast_times`)."""

from __future__ import annotations

import dataclasses

import pytest

from loom.cost.collectives import collective_time, group_span
from loom.cost.compute import fp8_quantize_bytes, fp8_quantize_kernels
from loom.cost.hardware import Device, Link, get_cluster
from loom.cost.layer import fp8_cast_times, piece_costs
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

# round numbers: 1 TB/s of memory at full efficiency, no launch overhead; fp8 at twice the bf16 peak
DEVICE = Device(
    name="round", peak_flops={"bf16": 100e12, "fp8": 200e12}, memory_gib=80, memory_bandwidth=1e12,
    matmul_efficiency=0.5, matmul_knee=0.0, attention_efficiency=0.5, memory_efficiency=1.0,
)  # fmt: skip
# hidden 64, 4 heads of 16, MLP 256 (not gated): GEMMs (128, 64, 192 / tp), (128, 64 / tp, 64), ...
GPT = TransformerConfig(layers=4, hidden=64, heads=4, vocab=128, dropout=False)
MOE = TransformerConfig(
    layers=4, hidden=64, heads=4, vocab=128, dropout=False, experts=8, top_k=2, ffn_hidden=32
)


def _cluster(latency_s: float = 0.0):
    """8 of `DEVICE` on links of unbounded bandwidth and `latency_s` per step."""
    link = Link(name="ideal", bandwidth=1e30, latency_s=latency_s)
    return dataclasses.replace(get_cluster("h100-sxm", gpus=8), device=DEVICE, intra=link, inter=link)


def test_quantize_bytes_amax_cast_and_transposed_copy():
    # bf16: amax reads 2 B, the cast reads 2 B and writes 1 B row-wise and 1 B column-wise per element
    assert fp8_quantize_bytes(1000) == (6000.0, 0.0)
    # the norm computed the amax (LayerNormLinear): no amax pass
    assert fp8_quantize_bytes(1000, amax_fused=True) == (4000.0, 0.0)
    # gathered over 4 ranks: the local 250 cast row-wise only, the backward transposes all 1000 (read + write)
    assert fp8_quantize_bytes(250, gathered=4) == (250 * 5.0, 2000.0)
    assert fp8_quantize_bytes(250, amax_fused=True, gathered=4) == (250 * 3.0, 2000.0)
    # an fp32 operand reads 4 B twice
    assert fp8_quantize_bytes(10, dtype="fp32") == (10 * (4 + 5 + 1.0), 0.0)
    assert fp8_quantize_kernels() == 3 and fp8_quantize_kernels(amax_fused=True) == 2
    with pytest.raises(ValueError, match="gathered=0 must be at least 1"):
        fp8_quantize_bytes(10, gathered=0)


def test_dense_layer_casts_with_sequence_parallelism():
    cluster = _cluster(latency_s=1e-6)
    plan = ParallelPlan(dp=4, tp=2, global_batch=4, seq=128, sequence_parallel=True, fp8_matmuls=True)
    # forward: qkv's and fc1's inputs (norm-fused, gathered: 128 * 64 / 2 local, 3 B each), the projection's
    # (128 x 32) and fc2's (128 x 128) inputs whole, 6 B each
    forward = 3 * 4096 + 6 * 4096 + 3 * 4096 + 6 * 16384
    # backward: qkv's (128 x 96) and fc1's (128 x 128) output gradients 6 B each; the projection's and fc2's
    # (gathered: 128 * 64 / 2 local) 5 B each and transposed whole (2 B x 8192); qkv's and fc1's inputs
    # transposed whole (2 B x 8192 each)
    backward = 6 * 12288 + 6 * 16384 + 2 * (5 * 4096 + 2 * 8192) + 2 * (2 * 8192)
    amax = collective_time("all_reduce", 4, group_span(2, 1, 8), cluster)  # one per gathered operand
    assert amax > 0
    fwd, bwd = fp8_cast_times(GPT, plan, cluster)
    assert fwd == pytest.approx(forward / 1e12 + 2 * amax, rel=1e-12)
    assert bwd == pytest.approx(backward / 1e12 + 2 * amax, rel=1e-12)
    # without sequence parallelism nothing is gathered: the transposes are made by the casts (4 B for the
    # norm-fused inputs, 6 B for the others)
    whole = dataclasses.replace(plan, sequence_parallel=False)
    fwd, bwd = fp8_cast_times(GPT, whole, cluster)
    assert fwd == pytest.approx((4 * 8192 + 6 * 4096 + 4 * 8192 + 6 * 16384) / 1e12, rel=1e-12)
    assert bwd == pytest.approx(6 * (12288 + 8192 + 16384 + 8192) / 1e12, rel=1e-12)
    # bf16 plans have no casts
    assert fp8_cast_times(GPT, dataclasses.replace(plan, fp8_matmuls=False), cluster) == (0.0, 0.0)


def test_delayed_scaling_casts_without_amax_passes_or_amax_all_reduces():
    # Transformer Engine 1.x's delayed scaling: every cast takes its scale from the amax history, so no
    # operand has an amax pass of its own and no amax is all-reduced before a gathered cast
    cluster = _cluster(latency_s=1e-6)
    plan = ParallelPlan(
        dp=4, tp=2, global_batch=4, seq=128, sequence_parallel=True, fp8_matmuls=True, fp8_scaling="delayed"
    )
    # forward: qkv's and fc1's inputs are written in fp8 by their norms (no cast); the projection's (128 x 32)
    # and fc2's (128 x 128) inputs cast with their transposed copies, 4 B each
    forward = 4 * 4096 + 4 * 16384
    # backward: qkv's and fc1's output gradients 4 B each; the projection's and fc2's gathered (3 B on 4096)
    # and transposed whole (2 B x 8192); qkv's and fc1's gathered fp8 inputs transposed (2 B x 8192 each)
    backward = 4 * 12288 + 4 * 16384 + 2 * (3 * 4096 + 2 * 8192) + 2 * (2 * 8192)
    fwd, bwd = fp8_cast_times(GPT, plan, cluster)
    assert fwd == pytest.approx(forward / 1e12, rel=1e-12)
    assert bwd == pytest.approx(backward / 1e12, rel=1e-12)
    assert fp8_quantize_kernels(delayed=True) == 1


def test_delayed_scaling_needs_fp8_matmuls():
    with pytest.raises(ValueError, match=r"fp8_scaling.*set fp8_matmuls too"):
        ParallelPlan(global_batch=4, seq=128, fp8_scaling="delayed")
    with pytest.raises(ValueError, match=r"fp8_scaling.*one of \('current', 'delayed'\)"):
        ParallelPlan(global_batch=4, seq=128, fp8_matmuls=True, fp8_scaling="mxfp8")


def test_expert_casts_one_quantizer_per_local_expert():
    overhead = dataclasses.replace(DEVICE, kernel_overhead_s=1e-6)
    cluster = dataclasses.replace(_cluster(), device=overhead)
    plan = ParallelPlan(dp=8, ep=4, global_batch=8, seq=128, fp8_matmuls=True)
    fwd, bwd = fp8_cast_times(MOE, plan, cluster)
    # attention as a dense layer's at tp 1: qkv's input 128 x 64 norm-fused (4 B, 2 kernels), the
    # projection's 128 x 64 (6 B, 3 kernels); 2 local experts of 4 * 128 * 2 / 8 = 128 routed tokens each,
    # fc1's input 128 x 64 and fc2's 128 x 32 per expert (6 B, 3 kernels per expert)
    forward = 4 * 8192 + 6 * 8192 + 6 * 2 * (128 * 64 + 128 * 32)
    assert fwd == pytest.approx(forward / 1e12 + (2 + 3 + 2 * 3 * 2) * 1e-6, rel=1e-12)
    # output gradients: qkv 128 x 192, projection 128 x 64, experts' fc1 128 x 32 and fc2 128 x 64 each
    backward = 6 * (128 * 192 + 8192 + 2 * (128 * 32 + 128 * 64))
    assert bwd == pytest.approx(backward / 1e12 + (3 + 3 + 2 * 3 * 2) * 1e-6, rel=1e-12)


def test_casts_are_a_breakdown_row_of_the_layer_and_rerun_with_full_recomputation():
    cluster = _cluster()
    plan = ParallelPlan(dp=8, global_batch=8, seq=128, fp8_matmuls=True, recompute="full")
    pieces = piece_costs(GPT, plan, cluster)
    fwd, bwd = fp8_cast_times(GPT, plan, cluster)
    assert pieces.layer_fwd["fp8_cast"] == fwd and pieces.layer_bwd["fp8_cast"] == bwd
    assert pieces.layer_recompute["fp8_cast"] == fwd
    assert "fp8_cast" not in piece_costs(GPT, dataclasses.replace(plan, fp8_matmuls=False), cluster).layer_fwd
