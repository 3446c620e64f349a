"""DeepEP's dispatch priced as its kernels send (`ParallelPlan.moe_dispatcher = "deepep"`, `loom.cost.moe`):
a token once per destination rank, across nodes once per destination node over RDMA and forwarded inside it
over NVLink; the expected counts exact against enumerating every routing of small cases."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from loom.cost.collectives import GroupSpan, collective_time, group_span
from loom.cost.hardware import PROFILES
from loom.cost.layer import piece_costs
from loom.cost.moe import COUNT_BYTES, deepep_bytes, deepep_time, expected_groups_hit
from loom.cost.plan import FieldError, ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.sim import simulate

H100 = PROFILES["h100-sxm"]


def _mean_groups(experts: int, top_k: int, groups: int) -> Fraction:
    """Distinct groups hit, averaged over every top-k set of experts (contiguous groups)."""
    held = experts // groups
    sets = list(itertools.combinations(range(experts), top_k))
    return Fraction(sum(len({e // held for e in chosen}) for chosen in sets), len(sets))


@pytest.mark.parametrize(
    "experts,top_k,groups", [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 3, 4), (12, 3, 3), (12, 4, 6), (16, 4, 4)]
)
def test_expected_groups_hit_is_the_enumerated_mean(experts, top_k, groups):
    assert expected_groups_hit(experts, top_k, groups) == pytest.approx(
        float(_mean_groups(experts, top_k, groups)), rel=1e-12
    )


def test_expected_groups_hit_by_hand_and_its_limits():
    # 8 experts in 4 pairs, top-2: a pair is missed by C(6,2)/C(8,2) = 15/28 of the draws, so 4 * 13/28
    assert expected_groups_hit(8, 2, 4) == pytest.approx(4 * 13 / 28, rel=1e-15)
    assert expected_groups_hit(8, 8, 4) == 4 and expected_groups_hit(8, 1, 4) == 1
    assert expected_groups_hit(128, 8, 128) == pytest.approx(8)  # one expert a group: every expert a copy
    with pytest.raises(ValueError, match="groups dividing experts"):
        expected_groups_hit(8, 2, 3)


def _deepep_sends(experts: int, top_k: int, ep: int, per_node: int) -> tuple[Fraction, Fraction]:
    """(RDMA, NVLink) copies one token of each source rank takes in DeepEP's internode dispatch, averaged
    over every top-k set and every source: one RDMA send to each other node holding one of its experts, to
    the rank of the source's local index there; that rank (the source itself in its own node) sends it over
    NVLink to each other rank of the node holding one of its experts."""
    held = experts // ep
    rdma = nvlink = Fraction(0)
    sets = list(itertools.combinations(range(experts), top_k))
    for source in range(ep):
        for chosen in sets:
            ranks = {e // held for e in chosen}
            for node in {r // per_node for r in ranks}:
                forwarder = node * per_node + source % per_node
                rdma += node != source // per_node
                nvlink += len({r for r in ranks if r // per_node == node} - {forwarder})
    draws = ep * len(sets)
    return rdma / draws, nvlink / draws


def _moe(experts: int, top_k: int) -> TransformerConfig:
    return TransformerConfig(name="moe", layers=2, hidden=64, heads=4, vocab=256, experts=experts, top_k=top_k,
                             gated_mlp=True)  # fmt: skip


@pytest.mark.parametrize(
    "experts,top_k,ep,per_node", [(8, 2, 4, 2), (16, 4, 8, 2), (16, 3, 8, 4), (8, 2, 4, 4)]
)
def test_deepep_bytes_are_the_enumerated_sends(experts, top_k, ep, per_node):
    model = _moe(experts, top_k)
    plan = ParallelPlan(dp=ep, ep=ep, global_batch=ep, seq=32, moe_dispatcher="deepep")
    span = GroupSpan(size=ep, per_node=per_node, nodes=ep // per_node)
    rdma, nvlink = _deepep_sends(experts, top_k, ep, per_node)
    token = 32 * 64 * 2  # the rank's tokens (micro-batch 1 of 32), hidden 64, bf16
    assert deepep_bytes(model, plan, span) == pytest.approx((token * rdma, token * nvlink), rel=1e-12)


def test_deepep_bytes_by_hand():
    """8 experts, top-2, ep 4 over 2 nodes of 2: a node is missed by C(4,2)/C(8,2) = 6/28 of the draws, a rank
    by 15/28: RDMA 1 * 22/28 copies of each token, NVLink (4 - 2) * 13/28; a flat all-to-all sends each
    token's 2 copies, half of them to the other node (1 copy over the network, 28/28)."""
    plan = ParallelPlan(dp=4, ep=4, global_batch=4, seq=32, moe_dispatcher="deepep")
    token = 32 * 64 * 2
    rdma, nvlink = deepep_bytes(_moe(8, 2), plan, GroupSpan(size=4, per_node=2, nodes=2))
    assert rdma == pytest.approx(token * 22 / 28, rel=1e-12) and nvlink == pytest.approx(token * 26 / 28)
    inside = deepep_bytes(_moe(8, 2), plan, GroupSpan(size=4, per_node=4, nodes=1))
    assert inside == (0.0, pytest.approx(token * 3 * 13 / 28, rel=1e-12))  # one copy per other rank hit


def test_qwen3_235b_on_32_ranks_over_4_nodes():
    """Qwen3-235B's 128 experts, top-8, ep 32 over 4 nodes of 8: a token reaches 4 (1 - C(96,8)/C(128,8)) =
    3.629 nodes, 2.722 of them remote (RDMA), against the flat all-to-all's 8 * 24/32 = 6 copies across
    nodes; and 32 (1 - C(124,8)/C(128,8)) = 7.359 ranks, 7.359 * 28/32 = 6.439 copies forwarded over NVLink."""
    p_node = 1 - math.comb(96, 8) / math.comb(128, 8)
    p_rank = 1 - math.comb(124, 8) / math.comb(128, 8)
    assert (4 * p_node, 32 * p_rank) == (pytest.approx(3.62901, abs=1e-5), pytest.approx(7.35937, abs=1e-5))
    model = TransformerConfig(name="q", layers=2, hidden=4096, heads=64, kv_heads=4, head_size=128,
                              vocab=151936, ffn_hidden=1536, gated_mlp=True, experts=128, top_k=8)  # fmt: skip
    plan = ParallelPlan(dp=16, tp=2, ep=32, expert_tp=1, global_batch=16, seq=4096, sequence_parallel=True,
                        moe_dispatcher="deepep")  # fmt: skip
    span = group_span(32, 1, H100.gpus_per_node)
    assert (span.nodes, span.per_node) == (4, 8)
    token = 4096 // 2 * 4096 * 2
    rdma, nvlink = deepep_bytes(model, plan, span)
    assert rdma == pytest.approx(token * 3 * p_node, rel=1e-12)
    assert nvlink == pytest.approx(token * 28 * p_rank, rel=1e-12)
    seconds = (
        H100.intra.latency_s
        + H100.inter.latency_s
        + max(rdma / H100.inter.bus_bandwidth, nvlink / H100.intra.bus_bandwidth)
    )
    assert deepep_time(model, plan, span, H100) == pytest.approx(seconds, rel=1e-12)
    # a layer's ep_comm per phase: the counts' all-to-all (forward) and a dispatch and a combine
    cluster = H100.with_size(32)
    pieces = piece_costs(model, plan, cluster)
    counts = collective_time("all_to_all", 128 * COUNT_BYTES, span, cluster)
    assert pieces.layer_fwd["ep_comm"] == pytest.approx(counts + 2 * seconds, rel=1e-12)
    assert pieces.layer_bwd["ep_comm"] == pytest.approx(2 * seconds, rel=1e-12)
    flat = piece_costs(model, plan.replace(moe_dispatcher="all_to_all"), cluster)
    assert flat.layer_fwd["ep_comm"] > 2 * pieces.layer_fwd["ep_comm"]
    assert (
        simulate(model, plan, cluster).breakdown["ep_comm"]
        < simulate(model, plan.replace(moe_dispatcher="all_to_all"), cluster).breakdown["ep_comm"]
    )


def test_an_unknown_dispatcher_is_named():
    with pytest.raises(FieldError, match="moe_dispatcher"):
        ParallelPlan(global_batch=1, seq=8, moe_dispatcher="nccl")


def test_loom_simulate_prices_deepep(capsys):
    from loom.cli.main import main

    args = ["simulate", "--layers", "2", "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--experts",
            "32", "--top-k", "4", "--hardware", "h100-sxm", "--gpus", "32", "--ep", "32", "--json"]  # fmt: skip
    seconds = {}
    for dispatcher in ("all_to_all", "deepep"):
        assert main([*args, "--moe-dispatcher", dispatcher]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["plan"]["moe_dispatcher"] == dispatcher
        seconds[dispatcher] = data["breakdown"]["ep_comm"]
    assert 0 < seconds["deepep"] < seconds["all_to_all"]


def test_deepep_is_refused_where_it_cannot_dispatch(capsys):
    # across nodes DeepEP pairs each rank with its counterpart in every other node: an ep group of 12 over
    # nodes of 8 (8 + 4) cannot run it; on a dense model the flag would say nothing: refused, naming the flag
    from loom.cli.main import main

    small = ["simulate", "--layers", "2", "--hidden", "1024", "--heads", "16", "--vocab", "32000"]
    args = [*small, "--hardware", "h100-sxm", "--moe-dispatcher", "deepep"]
    assert main([*args, "--experts", "48", "--top-k", "2", "--ep", "12", "--gpus", "24"]) == 1
    err = capsys.readouterr().err
    assert "--moe-dispatcher deepep across nodes needs the ep group in whole nodes alike" in err, err
    assert "holds 8 ranks in some of its 2 nodes and 4 in the last: use an ep that is a multiple of 8" in err
    assert main([*args, "--experts", "48", "--top-k", "2", "--ep", "16", "--gpus", "16"]) == 0
    capsys.readouterr()
    assert main([*args, "--gpus", "8"]) == 1
    assert (
        "--moe-dispatcher deepep says how MoE layers dispatch: it needs a mixture-of-experts"
        in capsys.readouterr().err
    )
