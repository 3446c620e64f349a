"""Tier 1: collective factors, group placement and hierarchy-aware pricing; hardware profiles."""

from __future__ import annotations

import json

import pytest

from loom.cost.collectives import GroupSpan, bus_factor, collective_time, group_span
from loom.cost.compute import matmul_efficiency, matmul_time, memory_time
from loom.cost.hardware import PROFILES, Device, get_cluster, save_cluster


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert (
        bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == bus_factor("all_to_all", 8) == 7 / 8
    )
    assert bus_factor("broadcast", 8) == bus_factor("reduce", 8) == bus_factor("send_recv", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("gossip", 4)


def test_group_span_places_tp_inside_and_dp_across_nodes():
    assert group_span(8, 1, 8) == GroupSpan(size=8, per_node=8, nodes=1)  # tp=8: one node
    assert group_span(16, 8, 8) == GroupSpan(size=16, per_node=1, nodes=16)  # dp over tp=8: one per node
    assert group_span(32, 1, 8) == GroupSpan(size=32, per_node=8, nodes=4)
    assert group_span(4, 2, 8) == GroupSpan(size=4, per_node=4, nodes=1)


def test_crossing_nodes_is_priced_at_the_nic_bandwidth():
    cluster = get_cluster("a100-80gb", gpus=64)
    nbytes = 1e9
    inside = collective_time("all_reduce", nbytes, group_span(8, 1, 8), cluster)
    one_rail = collective_time("all_reduce", nbytes, group_span(8, 8, 8), cluster)
    assert one_rail > 5 * inside  # 25 GB/s NIC against 300 GB/s NVLink
    expected = 2 * 7 / 8 * nbytes / cluster.inter.bus_bandwidth
    assert one_rail == pytest.approx(expected, rel=0.01)
    eight_rails = collective_time("all_reduce", nbytes, group_span(64, 1, 8), cluster)
    assert eight_rails < one_rail  # every device's NIC carries part of the ring


def test_collective_time_grows_with_size_and_is_zero_for_one_rank():
    cluster = PROFILES["h100-sxm"]
    span = group_span(8, 1, 8)
    times = [collective_time(kind, 2**20, span, cluster) for kind in ("all_gather", "all_reduce")]
    assert times[0] < times[1]
    assert collective_time("all_reduce", 2**20, group_span(1, 1, 8), cluster) == 0.0
    assert collective_time("all_reduce", 2**10, span, cluster) < collective_time(
        "all_reduce", 2**30, span, cluster
    )


def test_gathers_and_scatters_pay_a_ring_hop_per_member():
    """Across nodes NCCL runs all-gather and reduce-scatter only as rings: n - 1 hops, nodes - 1 of them
    over the network, so their latency grows with the group (an all-reduce's tree grows with log2 of it)."""
    cluster = get_cluster("a100-80gb", gpus=512)
    intra, inter = cluster.intra.latency_s, cluster.inter.latency_s
    span = group_span(512, 1, 8)  # 64 nodes of 8
    for kind in ("all_gather", "reduce_scatter"):
        wire = 1e6 * bus_factor(kind, 512) / (8 * cluster.inter.bus_bandwidth)
        expected = (511 - 63) * intra + 63 * inter + wire
        assert collective_time(kind, 1e6, span, cluster) == pytest.approx(expected, rel=1e-12)
    two_nodes = group_span(16, 1, 8)
    wire = 1e6 * 15 / 16 / (8 * cluster.inter.bus_bandwidth)
    expected = 14 * intra + inter + wire
    assert collective_time("reduce_scatter", 1e6, two_nodes, cluster) == pytest.approx(expected, rel=1e-12)
    tree = collective_time("all_reduce", 1.0, span, cluster)
    assert tree == pytest.approx(2 * 9 * inter + 2 * 511 / 512 / (8 * cluster.inter.bus_bandwidth), rel=1e-9)
    assert collective_time("all_gather", 1.0, span, cluster) > 10 * tree


def test_matmul_efficiency_rises_with_size_and_roofline_applies():
    device = PROFILES["a100-80gb"].device
    assert (
        matmul_efficiency(device, 128, 128, 128)
        < matmul_efficiency(device, 8192, 8192, 8192)
        < device.matmul_efficiency
    )
    big = matmul_time(device, 8192, 8192, 8192, dtype="fp16")
    assert big == pytest.approx(2 * 8192**3 / (312e12 * matmul_efficiency(device, 8192, 8192, 8192)))
    thin = matmul_time(device, 8192, 8192, 1, dtype="fp16")  # a matrix-vector product is memory-bound
    assert thin == pytest.approx(
        (8192 * 8192 + 8192 + 8192) * 2 / (device.memory_bandwidth * device.memory_efficiency)
    )
    assert memory_time(device, 2.039e12 * device.memory_efficiency) == pytest.approx(1.0)


def test_every_profile_is_valid_and_round_trips_through_json(tmp_path):
    for name, cluster in PROFILES.items():
        assert cluster.device.peak("bf16") > 0 and cluster.device.memory_gib > 0, name
        path = tmp_path / f"{name}.json"
        save_cluster(cluster.with_size(16), path)
        loaded = get_cluster(str(path))
        assert loaded == cluster.with_size(16)
        assert json.loads(path.read_text())["device"]["name"] == name


def test_hardware_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="a100-80gb"):
        get_cluster("tpu-v9")
    with pytest.raises(ValueError, match="matmul_efficiency"):
        Device(name="x", peak_flops={"fp16": 1e12}, memory_gib=1, memory_bandwidth=1e9, matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="no fp8 peak"):
        PROFILES["a100-80gb"].device.peak("fp8")
