"""A dropless MoE dispatch synchronises host and device in every MoE layer's forward (`ParallelPlan.moe_sync`):
the host's and the device's timelines (`loom.cost.host`) and what a layer pass costs when the host sets its
pace."""

import dataclasses
import json

import pytest

from loom.cost.hardware import get_cluster
from loom.cost.host import Segment, host_bound_pass
from loom.cost.layer import MOE_KERNELS, layer_kernels, moe_kernels, piece_costs
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
    dispatch, combine): 17; Megatron-Core's MoE layer adds its router's 8 (random logits 2, fused top-k,
    aux-loss scores, tokens per expert, aux loss, logging 2), the permutation's 4 (row-id map 3, unpermute),
    the all-to-all dispatcher's 12 (split sizes 7, copies to the host 4, the probs' all-to-all) and the sort
    by local expert's 4: 45. Backward: 14 GEMMs, 1, 6 and the 2 reverse all-to-alls: 23; the router's 10
    (aux-loss gradient 2, three fused backwards, the logits' gradients summed, fp32 casts 4), the weighted
    SwiGLU's probs gradient, the unpermute's permute, the probs' all-to-all and the two sorts back: 38."""
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    assert layer_kernels(MOE, plan, CLUSTER) == {"forward": 45, "backward": 38}
    # DeepEP: layout, notify + dispatch, notify + combine (5) for the 3 all-to-alls; its top-k (2) and
    # multihot map (17) for the split sizes, copies, probs' exchange and sort; backward 4 + 3 for 2 + 1 + 2
    deepep = plan.replace(moe_dispatcher="deepep")
    assert layer_kernels(MOE, deepep, CLUSTER) == {"forward": 50, "backward": 40}
    # Hybrid-EP: all-gather, metadata, row-id map, dispatch, unpermute, combine (6), and no separate
    # permutation: forward 17 - 3 + 6 + 8, backward 23 - 2 + 3 + 10 + 1
    hybrid = plan.replace(moe_dispatcher="hybridep")
    assert layer_kernels(MOE, hybrid, CLUSTER) == {"forward": 28, "backward": 35}


def test_moe_kernels_pieces_follow_the_plan():
    """Which rows of the table a layer launches: the counts' all-reduce over tp x cp, the exchanges of the
    probs over expert tp, the flex dispatcher's copies over expert tp, fp8 padding except under Hybrid-EP,
    the sort only with more than one local expert, nothing for a dense model."""
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    assert list(moe_kernels(MOE, plan)) == [
        "router",
        "experts",
        "permutation",
        "all_to_all",
        "all_to_all_sort",
    ]
    tp = ParallelPlan(tp=2, dp=4, ep=4, global_batch=4, seq=16, sequence_parallel=True, fp8_matmuls=True)
    assert list(moe_kernels(MOE, tp)) == [
        "router", "experts", "router_tp", "permutation", "fp8_padding", "all_to_all", "all_to_all_etp",
        "all_to_all_sort",
    ]  # fmt: skip
    assert "all_to_all_sort" not in moe_kernels(
        MOE, tp.replace(ep=8, dp=8, global_batch=8)
    )  # one expert each
    whole = tp.replace(expert_tp=1, moe_dispatcher="hybridep")
    assert list(moe_kernels(MOE, whole)) == ["router", "experts", "router_tp"]
    assert list(moe_kernels(MOE, whole.replace(expert_tp=2, moe_dispatcher="deepep")))[-2:] == [
        "deepep",
        "flex_etp",
    ]
    assert moe_kernels(MOE.replace(experts=1, top_k=1), ParallelPlan(global_batch=1, seq=8)) == {}
    # the table's totals per layer pass, forward / backward
    totals = {
        name: (sum(k.forward for k in rows), sum(k.backward for k in rows))
        for name, rows in MOE_KERNELS.items()
    }
    assert totals == {
        "router": (8, 10), "router_tp": (1, 0), "experts": (0, 1), "permutation": (4, 1), "fp8_padding": (3, 3),
        "all_to_all": (12, 1), "all_to_all_etp": (3, 3), "all_to_all_sort": (4, 2), "deepep": (19, 3),
        "flex_etp": (2, 0),
    }  # fmt: skip


def test_hybridep_sends_as_deepep_and_launches_its_own_kernels():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True, moe_dispatcher="deepep")
    deepep, hybrid = (piece_costs(MOE, p, CLUSTER) for p in (plan, plan.replace(moe_dispatcher="hybridep")))
    assert (hybrid.layer_fwd["ep_comm"], hybrid.layer_bwd["ep_comm"]) == (
        deepep.layer_fwd["ep_comm"], deepep.layer_bwd["ep_comm"],
    )  # fmt: skip
    assert hybrid.layer_fwd["host_bound"] < deepep.layer_fwd["host_bound"]  # 28 launches, not 50


def _device(costs):
    return sum(value for name, value in costs.items() if name != "host_bound")


def test_a_short_layer_pass_runs_at_the_host_pace():
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=16, flash_attention=True)
    pieces = piece_costs(MOE, plan, CLUSTER)
    for costs, kernels in ((pieces.layer_fwd, 45), (pieces.layer_bwd, 38)):
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
    assert _device(pieces.layer_fwd) > 45 * LAUNCH
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
