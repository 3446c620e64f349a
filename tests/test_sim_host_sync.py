"""A dropless MoE dispatch synchronises host and device in every MoE layer's forward (`ParallelPlan.moe_sync`):
the host's and the device's timelines (`loom.cost.host`) and what a layer pass costs when the host sets its
pace."""

import dataclasses
import json

import pytest

from loom.cost.hardware import get_cluster
from loom.cost.host import Segment, host_bound_pass
from loom.cost.layer import layer_kernels, piece_costs
from loom.cost.plan import FieldError, ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.sim import simulate

MOE = TransformerConfig(
    layers=2, hidden=64, heads=4, vocab=100, experts=8, top_k=2, biases=False, dropout=False
)
LAUNCH = 20e-6
CLUSTER = get_cluster("h100-sxm", gpus=4)
CLUSTER = dataclasses.replace(CLUSTER, device=dataclasses.replace(CLUSTER.device, host_kernel_s=LAUNCH))


def _kernels(run):
    return [(start, end) for kind, _, start, end in run.intervals if kind == "kernel"]


def test_host_bound_when_the_pass_is_short():
    # 10 kernels of 0.1 ms each, launched every 0.3 ms after the sync: each runs as soon as it is enqueued
    run = host_bound_pass([Segment(device_s=1e-3, kernels=10)], 0.3e-3)
    assert _kernels(run) == [pytest.approx((0.3e-3 * k, 0.3e-3 * k + 0.1e-3)) for k in range(1, 11)]
    assert run.end == pytest.approx(3.1e-3) and run.exposed == pytest.approx(2.1e-3)


def test_host_hidden_when_the_pass_is_long():
    # 10 kernels of 1 ms: after the first launch the host runs ahead and the kernels run back to back
    run = host_bound_pass([Segment(device_s=10e-3, kernels=10)], 0.3e-3)
    assert _kernels(run) == [pytest.approx((0.3e-3 + k * 1e-3, 1.3e-3 + k * 1e-3)) for k in range(10)]
    assert run.end == pytest.approx(10.3e-3) and run.exposed == pytest.approx(0.3e-3)  # the first launch only


def test_a_sync_makes_the_host_wait_for_the_device():
    # 2 kernels of 0.5 ms, launches of 1 ms: without the sync the next segment's launches start at 2 ms
    synced = host_bound_pass([Segment(device_s=1e-3, kernels=2), Segment(device_s=1e-3, kernels=2)], 1e-3)
    free = host_bound_pass(
        [Segment(device_s=1e-3, kernels=2, sync=False), Segment(device_s=1e-3, kernels=2)], 1e-3
    )
    assert _kernels(synced)[2:] == [pytest.approx((3.5e-3, 4e-3)), pytest.approx((4.5e-3, 5e-3))]
    assert _kernels(free)[2:] == [pytest.approx((3e-3, 3.5e-3)), pytest.approx((4e-3, 4.5e-3))]
    assert (synced.end, free.end) == (pytest.approx(5e-3), pytest.approx(4.5e-3))


def test_bad_segments_and_launch_costs_are_refused():
    with pytest.raises(ValueError, match="kernels >= 1"):
        Segment(device_s=1.0, kernels=0)
    with pytest.raises(ValueError, match="launch_s"):
        host_bound_pass([Segment(device_s=1.0, kernels=1)], -1.0)


def test_layer_kernels_of_a_small_mixture():
    """ep 4 of 8 experts: 2 local experts. Forward: query/key/value, output projection, 2 linears x 2 local
    experts, router (7 GEMMs), one fused attention kernel, 6 memory-bound kernels and 3 all-to-alls (counts,
    dispatch, combine): 17. Backward: 14 GEMMs, 1, 6 and the 2 reverse all-to-alls: 23."""
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    assert layer_kernels(MOE, plan, CLUSTER) == {"forward": 17, "backward": 23}
    deepep = plan.replace(moe_dispatcher="deepep")  # the counts' all-to-all, a dispatch and a combine
    assert layer_kernels(MOE, deepep, CLUSTER) == {"forward": 17, "backward": 23}


def _device(costs):
    return sum(value for name, value in costs.items() if name != "host_bound")


def test_a_short_layer_pass_runs_at_the_host_pace():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    pieces = piece_costs(MOE, plan, CLUSTER)
    for costs, kernels in ((pieces.layer_fwd, 17), (pieces.layer_bwd, 23)):
        device = _device(costs)
        assert device < kernels * LAUNCH  # a short pass: the host is the slower timeline
        # each kernel runs when enqueued: the last one ends its share of the device time after the last launch
        assert costs["host_bound"] == pytest.approx(kernels * LAUNCH + device / kernels - device, rel=1e-12)
    dropped = piece_costs(MOE, plan.replace(moe_sync="token_drop"), CLUSTER)
    assert "host_bound" not in dropped.layer_fwd and "host_bound" not in dropped.layer_bwd
    assert dropped.layer_fwd == {k: v for k, v in pieces.layer_fwd.items() if k != "host_bound"}


def test_a_long_layer_pass_hides_the_host():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, micro_batch=1, seq=8192, flash_attention=True)
    model = MOE.replace(hidden=2048, heads=16)
    pieces = piece_costs(model, plan, CLUSTER)
    assert _device(pieces.layer_fwd) > 17 * LAUNCH
    assert pieces.layer_fwd["host_bound"] == pytest.approx(LAUNCH, rel=1e-9)  # only the launch after the sync


def test_full_recomputation_syncs_again():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True, recompute="full")
    pieces = piece_costs(MOE, plan, CLUSTER)
    assert pieces.layer_recompute["host_bound"] == pieces.layer_fwd["host_bound"] > 0


def test_simulate_charges_the_host_bound_row():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    synced, dropped, graphed = (
        simulate(MOE, plan.replace(moe_sync=sync), CLUSTER)
        for sync in ("dropless", "token_drop", "cuda_graph")
    )
    pieces = piece_costs(MOE, plan, CLUSTER)
    # 2 layers on the only stage, one micro-batch: each pays its forward's and its backward's host bound
    expected = 2 * (pieces.layer_fwd["host_bound"] + pieces.layer_bwd["host_bound"])
    assert synced.breakdown["host_bound"] == pytest.approx(expected, rel=1e-12)
    assert "host_bound" not in dropped.breakdown and dropped.iteration_s == graphed.iteration_s
    assert synced.iteration_s == pytest.approx(dropped.iteration_s + expected, rel=1e-9)


def test_an_unknown_sync_is_named():
    with pytest.raises(FieldError, match="moe_sync"):
        ParallelPlan(global_batch=1, seq=8, moe_sync="sometimes")


def test_loom_simulate_takes_moe_sync(capsys):
    from loom.cli.main import main

    args = ["simulate", "--layers", "2", "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--experts",
            "32", "--top-k", "4", "--hardware", "h100-sxm", "--gpus", "8", "--ep", "8", "--json"]  # fmt: skip
    seconds = {}
    for sync in ("dropless", "token_drop"):
        assert main([*args, "--moe-sync", sync]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["plan"]["moe_sync"] == sync
        seconds[sync] = data["iteration_s"]
    assert seconds["dropless"] > seconds["token_drop"]
    dense = [
        "simulate",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--vocab",
        "32000",
        "--gpus",
        "8",
    ]
    assert main([*dense, "--moe-sync", "token_drop"]) != 0
    assert "needs a mixture-of-experts model (--experts)" in capsys.readouterr().err
