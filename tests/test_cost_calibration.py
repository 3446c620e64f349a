"""Tier 1: the calibration's fits and the terms the simulator charges from a measured profile: the matmul
shape curve fitted to the model's own GEMM shapes, the elementwise kernels' share of the memory bandwidth,
and the per-kernel overhead times the kernels the simulator counts."""

from __future__ import annotations

import dataclasses

import pytest

from loom.cost.calibrate import build_profile, fit_link, fit_matmul, measure_rank
from loom.cost.hardware import Cluster, Device, Link
from loom.cost.layer import gemm_shapes, piece_costs
from loom.cost.plan import ParallelPlan
from loom.cost.transformer import TransformerConfig

TINY = TransformerConfig(layers=2, hidden=256, heads=4, vocab=1024, learned_positions=128, dropout=False)
TINY_PLAN = ParallelPlan(dp=2, micro_batch=8, global_batch=16, seq=128, dtype="fp32")


def _rate(shape: tuple[int, int, int], peak: float, knee: float) -> float:
    m, k, n = shape
    return peak * m / (m + knee) * k / (k + knee) * n / (n + knee)


def test_the_fit_meets_two_squares_exactly():
    points = [((n, n, n), _rate((n, n, n), 2e11, 100.0)) for n in (128, 512)]
    peak, knee = fit_matmul(points)
    assert peak == pytest.approx(2e11, rel=1e-9) and knee == pytest.approx(100.0, rel=1e-9)


def test_the_fit_recovers_the_curve_from_the_model_s_rectangular_shapes():
    shapes = gemm_shapes(TINY, TINY_PLAN)
    peak, knee = fit_matmul([(s, _rate(s, 9e10, 40.0)) for s in shapes])
    assert peak == pytest.approx(9e10, rel=1e-9) and knee == pytest.approx(40.0, rel=1e-9)


def test_rates_that_fall_with_size_give_no_knee_and_the_flop_weighted_mean_rate():
    small, large = (128, 128, 128), (512, 512, 512)
    peak, knee = fit_matmul([(small, 8e9), (large, 4e9)])
    assert knee == 0.0
    # weighted geometric mean of the rates, the 64x larger GEMM weighing 64 times more
    assert peak == pytest.approx(4e9 * 2 ** (1 / 65), rel=1e-9)


def test_gemm_shapes_are_the_layers_linears_its_attention_scores_and_the_head():
    assert gemm_shapes(TINY, TINY_PLAN) == [
        (128, 64, 128),  # scores per head: seq x head_dim x seq
        (1024, 256, 256),  # output projection: tokens x hidden x hidden
        (1024, 256, 768),  # query/key/value
        (1024, 256, 1024),  # MLP up, and the head (tokens x hidden x vocab)
        (1024, 1024, 256),  # MLP down
    ]
    sharded = gemm_shapes(TINY, dataclasses.replace(TINY_PLAN, dp=1, tp=2))
    assert (1024, 256, 384) in sharded and (1024, 512, 256) in sharded and (1024, 256, 512) in sharded


def _ranks(memory: float, elementwise: float | None) -> list[dict]:
    rank = {
        "matmul": [{"size": 128, "shape": (128, 128, 128), "seconds": 1e-3, "flops_per_s": 4e9}],
        "memory_bandwidth": memory,
        "kernel_overhead_s": 5e-6,
        "collectives": [],
    }
    if elementwise is not None:
        rank["elementwise_bandwidth"] = elementwise
    return [rank, dict(rank, memory_bandwidth=2 * memory)]


def test_the_elementwise_kernels_share_of_the_bandwidth_is_the_memory_efficiency():
    device = build_profile(_ranks(1e10, 2.5e9), 2).cluster.device
    assert device.memory_bandwidth == 1e10  # the slowest rank
    assert device.memory_efficiency == pytest.approx(0.25)
    assert build_profile(_ranks(1e10, None), 2).cluster.device.memory_efficiency == 1.0  # not measured


def test_kernel_overhead_is_charged_per_kernel_the_simulator_counts():
    """With compute and memory free, a step's pieces cost the overhead times their kernels: a layer's
    forward runs 4 linear GEMMs and 2 attention GEMMs, 6 elementwise kernels and 2 in its attention
    (scale/mask/softmax); a backward counts twice its forward's."""
    overhead = 1e-3
    device = Device(
        name="free",
        peak_flops={"fp32": 1e30},
        memory_gib=80,
        memory_bandwidth=1e30,
        kernel_overhead_s=overhead,
    )
    link = Link(name="l", bandwidth=1e9, latency_s=0.0)
    cluster = Cluster(device=device, intra=link, inter=link, gpus=2, gpus_per_node=2)
    pieces = piece_costs(TINY, TINY_PLAN, cluster)
    assert pieces.layer_fwd["matmul"] == pytest.approx(6 * overhead)
    assert pieces.layer_fwd["elementwise"] == pytest.approx(8 * overhead)
    assert pieces.layer_bwd["matmul"] == pytest.approx(12 * overhead)
    assert pieces.layer_bwd["elementwise"] == pytest.approx(16 * overhead)
    assert pieces.head_fwd["matmul"] == pytest.approx(overhead)


def test_a_single_rank_measures_every_term_at_the_shapes_given():
    out = measure_rank([(64, 32, 48), 32], (), repeats=1, activation_elements=4096)
    assert [row["shape"] for row in out["matmul"]] == [(64, 32, 48), (32, 32, 32)]
    assert all(row["flops_per_s"] > 0 and row["seconds"] > 0 for row in out["matmul"])
    assert out["elementwise_bandwidth"] > 0 and out["memory_bandwidth"] > 0 and out["kernel_overhead_s"] > 0
    assert out["collectives"] == []


def test_a_noisy_large_all_reduce_does_not_hide_the_latency():
    """The link is fitted on relative error: a 4 MiB buffer measured 10% slow moves the latency by about 1%
    (a fit in plain seconds, dominated by that buffer, moves it by 17%)."""
    latency, bandwidth = 100e-6, 1e9  # per step (2 on 2 ranks), bytes/s of bus
    points = [(b, 2 * latency + b / bandwidth) for b in (4096, 65536, 1 << 20)]
    points.append((1 << 22, 1.1 * (2 * latency + (1 << 22) / bandwidth)))
    fitted_latency, fitted_bandwidth = fit_link(points, 2)
    assert fitted_latency == pytest.approx(latency, rel=0.02)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=0.06)
