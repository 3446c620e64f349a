"""Tier 1: the simulator prices context parallelism (cp) with `loom.cost.context`'s formulas: the bytes of
each layer's exchanges, the exposed communication of a step, the compute of the rank's share of attention,
and memory per rank falling with cp; `loom simulate --cp`; the planner choosing cp for a long sequence."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loom.cli.main import main
from loom.cost.collectives import collective_time, group_span
from loom.cost.context import (
    GRAD_BYTES,
    attention_flops,
    communication_time,
    exposed_time,
    megatron_p2p_collectives,
    ring_collectives,
    ulysses_collectives,
)
from loom.cost.hardware import GIB, PROFILES, Device
from loom.cost.layer import piece_costs
from loom.cost.memory import layer_activation_bytes
from loom.cost.plan import FieldError, ParallelPlan
from loom.cost.transformer import TransformerConfig
from loom.plan import Plan
from loom.plan.outer import search_plans, to_plan
from loom.plan.outer_space import Mesh, micro_batch_sizes
from loom.sim import check_plan, simulate
from loom.train.config import load_config

# Llama-like: 32 heads of 128, 8 key/value heads (grouped-query attention), no dropout
MODEL = TransformerConfig(
    name="gqa", layers=4, hidden=4096, heads=32, kv_heads=8, vocab=32000, ffn_hidden=14336, gated_mlp=True,
    norm="rmsnorm", biases=False, dropout=False, tied_embeddings=False,
)  # fmt: skip
H100 = PROFILES["h100-sxm"]
FORMULAS = {
    "ulysses": ulysses_collectives,
    "ring": ring_collectives,
    "megatron_p2p": megatron_p2p_collectives,
}


def _plan(cp: int, attention: str = "ulysses", **changes) -> ParallelPlan:
    """8 devices: dp = 8 / (cp * tp), one sequence of 8192 tokens per replica and micro-batch."""
    tp = changes.pop("tp", 1)
    dp = 8 // (cp * tp)
    fields = dict(dp=dp, tp=tp, cp=cp, attention=attention, global_batch=2 * dp, seq=8192) | changes
    return ParallelPlan(**fields)


def _formula(attention: str, plan: ParallelPlan) -> list:
    return FORMULAS[attention](
        batch=plan.micro_batch, seq=plan.seq, heads=MODEL.heads // plan.tp, kv_heads=MODEL.kv // plan.tp,
        head_dim=MODEL.head_dim, cp=plan.cp, dtype_bytes=2,
    )  # fmt: skip


def _sent(collectives) -> int:  # noqa: ANN001
    return sum(c.count * c.nbytes for c in collectives if c.kind != "recv")


def test_bytes_per_layer_are_the_formulas():
    """seq 8192 over cp = 4 (2048 positions per rank), head_dim 128, bf16: one head over the rank's positions
    is 2048 * 128 * 2 = 512 KiB. Ulysses: q (32 heads), k and v (8 heads each, cp = 4 divides them) out and
    back forward, and again backward: 2 * (48 + 32) heads = 80 MiB. Ring: 3 exchanges of k and v (2 * 8 heads
    = 8 MiB) forward, 3 backward, and 4 of their fp32 gradients (16 MiB): 112 MiB."""
    for attention, mib in (("ulysses", 80), ("ring", 112)):
        plan = _plan(4, attention)
        pieces = piece_costs(MODEL, plan, H100)
        assert list(pieces.layer_cp) == _formula(attention, plan)
        result = simulate(MODEL, plan, H100)
        assert result.cp_bytes_per_layer == _sent(_formula(attention, plan)) == mib * 2**20
    # with tp = 2 each tp rank sends its heads' share: half
    assert simulate(MODEL, _plan(2, "ring", tp=2), H100).cp_bytes_per_layer == _sent(
        _formula("ring", _plan(2, "ring", tp=2))
    )
    assert simulate(MODEL, _plan(1), H100).cp_bytes_per_layer == 0


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_steps_ulysses_communication_is_the_formula_times_layers(cp):
    """Ulysses' all-to-alls are waited on where they are issued: the step's cp_comm is the formula's time
    for one layer, times layers and micro-batches, on the cp group as the mesh places it (ranks tp apart)."""
    plan = _plan(cp, micro_batch=1)
    result = simulate(MODEL, plan, H100)
    span = group_span(cp, plan.tp, H100.gpus_per_node)
    per_layer = communication_time(_formula("ulysses", plan), span, H100)
    assert per_layer > 0
    assert result.breakdown["cp_comm"] == pytest.approx(
        MODEL.layers * plan.micro_batches * per_layer, rel=1e-12
    )


def test_ring_exchanges_hide_behind_the_blocks_and_the_gradients_do_not():
    """Inside one node the key/value exchange of a ring step is quicker than the step's block of attention:
    all hidden. The gradients' exchanges are waited on at once (`loom.parallel.ring`): cp of them exposed
    per layer. With compute free nothing hides: the whole formula is exposed."""
    plan = _plan(4, "ring")
    span = group_span(4, 1, H100.gpus_per_node)
    kv_bytes = 2 * 8 * 2048 * 128 * 2
    kv = collective_time("send_recv", kv_bytes, span, H100)
    grads = collective_time("send_recv", kv_bytes // 2 * GRAD_BYTES, span, H100)
    forward = piece_costs(MODEL, plan, H100).layer_fwd
    assert kv < forward["matmul"] / 4 / 4  # far below a step's block (a share of the layer's GEMMs)
    result = simulate(MODEL, plan, H100)
    layers = MODEL.layers * plan.micro_batches
    assert result.breakdown["cp_comm"] == pytest.approx(layers * 4 * grads, rel=1e-12)

    free = dataclasses.replace(
        H100.device, peak_flops={"bf16": 1e30}, memory_bandwidth=1e30, kernel_overhead_s=0
    )
    cluster = dataclasses.replace(H100, device=free)
    everything = communication_time(_formula("ring", plan), span, cluster)
    assert simulate(MODEL, plan, cluster).breakdown["cp_comm"] == pytest.approx(layers * everything, rel=1e-9)
    # the exposed parts of both phases, with nothing to hide behind, are the whole
    both = sum(
        exposed_time(_formula("ring", plan), span, H100, phase=p, step_s=0) for p in ("forward", "backward")
    )
    assert both == pytest.approx(communication_time(_formula("ring", plan), span, H100), rel=1e-12)


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_a_ranks_compute_is_its_share_of_the_attention(attention):
    """On a device whose GEMMs run at one speed whatever their shape (no knee, no memory bound), a layer's
    GEMM seconds times that speed are the rank's FLOPs: the dense ones of its seq / cp tokens, and
    `attention_flops` of its queries against the whole sequence (ring: the head-tail cut's half of the
    causal square, backward recomputing the scores; Ulysses without fused attention: heads / cp over the
    whole square, as the unfused kernel computes it)."""
    ideal = Device(name="ideal", peak_flops={"bf16": 1e15}, memory_gib=80, memory_bandwidth=1e30,
                   matmul_efficiency=0.5, matmul_knee=0)  # fmt: skip
    cluster = dataclasses.replace(H100, device=ideal)
    plan = _plan(4, attention)
    pieces = piece_costs(MODEL, plan, cluster)
    tokens = plan.seq // plan.cp * plan.micro_batch
    dense = tokens * MODEL.layer_forward_flops_per_token(plan.seq)["dense"]
    layout, causal = ("head_tail", True) if attention == "ring" else ("contiguous", False)
    forward, backward = attention_flops(
        batch=1, seq=plan.seq, heads=MODEL.heads, head_dim=MODEL.head_dim, cp=4, kind=attention, layout=layout,
        causal=causal,
    )  # fmt: skip
    speed = 1e15 * 0.5
    assert pieces.layer_fwd["matmul"] * speed == pytest.approx(dense + forward, rel=1e-12)
    if attention == "ring":
        assert pieces.layer_bwd["matmul"] * speed == pytest.approx(2 * dense + backward, rel=1e-12)


def test_memory_per_rank_falls_with_cp():
    """Every activation a layer keeps is per token, but the scores, which Ulysses keeps for its heads / cp
    over whole sequences: a cp rank keeps 1/cp of the one-rank bytes. Ring attention works block by block
    and keeps no scores, as a fused kernel."""
    s = 16384
    for cp in (2, 4, 8):
        one = layer_activation_bytes(MODEL, s, 1, 1)
        assert layer_activation_bytes(MODEL, s, 1, 1, cp=cp) == pytest.approx(one / cp, rel=1e-12)
        fused = layer_activation_bytes(MODEL, s, 1, 1, flash_attention=True)
        assert layer_activation_bytes(MODEL, s, 1, 1, cp=cp, attention="ring") == pytest.approx(fused / cp)
    # a step on 8 devices, one sequence of 16K tokens per micro-batch: data parallel vs cut over 8 ranks
    # (optimizer level 1: states sharded over dp x cp alike)
    whole = simulate(MODEL, _plan(1, seq=s, optimizer_level=1), H100)
    cut = simulate(MODEL, _plan(8, "ring", seq=s, optimizer_level=1), H100)
    assert cut.memory_breakdown_gib["model_states"] == pytest.approx(
        whole.memory_breakdown_gib["model_states"]
    )
    assert cut.memory_breakdown_gib["activations"] < whole.memory_breakdown_gib["activations"] / 8
    gib = [
        simulate(MODEL, _plan(cp, seq=s, optimizer_level=1), H100).memory_per_device_gib
        for cp in (1, 2, 4, 8)
    ]
    assert gib == sorted(gib, reverse=True) and gib[-1] < gib[0] / 3  # autocast's weight copies stay whole


def test_plans_loom_cannot_run_give_reasons():
    reasons = check_plan(MODEL, _plan(8, tp=1, seq=8192).replace(attention="ulysses"), H100)
    assert reasons == []  # 8 divides 32 heads
    wide = ParallelPlan(tp=8, cp=8, global_batch=1, seq=8192)
    heads = check_plan(MODEL, wide, H100.with_size(64))
    assert any("tp*cp = 8*8 must divide the 32 heads" in r for r in heads), heads
    assert check_plan(MODEL, wide.replace(attention="ring"), H100.with_size(64)) == []
    odd = check_plan(MODEL, _plan(4, "ring", seq=8196), H100)
    assert any("2*cp = 8 chunks, but seq 8196" in r for r in odd), odd
    assert any("does not cut into cp=8" in r for r in check_plan(MODEL, _plan(8, seq=8196), H100))
    sp = check_plan(MODEL, _plan(2, tp=4, seq=8196, sequence_parallel=True), H100)
    assert any("multiple of tp*cp = 8" in r for r in sp), sp


def test_cp_inside_pipeline_stages_is_priced_per_stage():
    # each stage's ranks exchange for the stage's layers only: per device, half the layers' cp traffic at pp=2
    piped = ParallelPlan(dp=2, pp=2, cp=2, attention="ring", global_batch=8, micro_batch=1, seq=8192)
    whole = simulate(MODEL, piped.replace(pp=1), H100.with_size(4))  # the same micro-batches per device
    assert check_plan(MODEL, piped, H100.with_size(8)) == []
    staged = simulate(MODEL, piped, H100.with_size(8))
    assert staged.breakdown["cp_comm"] == pytest.approx(whole.breakdown["cp_comm"] / 2, rel=1e-9)
    # what a stage sends on is each rank's piece of the sequence: seq / cp tokens of its rows
    rank_piece = piece_costs(MODEL, piped, H100).p2p_bytes
    assert rank_piece == piped.micro_batch * 8192 // 2 * MODEL.hidden * 2  # bf16 stream
    # the next stage is tp * cp * dp ranks on: with tp 2, cp 4 it sits on the next node (tp * dp = 2 would
    # have placed it inside this one)
    wide = ParallelPlan(tp=2, pp=2, cp=4, attention="ring", global_batch=4, micro_batch=1, seq=8192)
    pieces = piece_costs(MODEL, wide, H100)
    across = collective_time("send_recv", pieces.p2p_bytes, group_span(2, 8, H100.gpus_per_node), H100)
    assert pieces.p2p_s == across > collective_time("send_recv", pieces.p2p_bytes, group_span(2, 2, 8), H100)


def test_experts_under_cp_are_priced():
    moe = MODEL.replace(experts=8, top_k=2)
    one, two = (_plan(1, "ring", ep=4), _plan(2, "ring", ep=4))
    assert check_plan(moe, two, H100) == []
    alone, cut = simulate(moe, one, H100), simulate(moe, two, H100)
    assert cut.breakdown["cp_comm"] > 0 and alone.breakdown.get("cp_comm", 0) == 0
    # a rank routes its own tokens: half of them at cp = 2 (dp halves, the global batch with it); the
    # exchanges' latency does not halve
    assert alone.breakdown["ep_comm"] / 2 < cut.breakdown["ep_comm"] < alone.breakdown["ep_comm"]


SIM = ["simulate", "--layers", "4", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--vocab", "32000",
       "--swiglu", "--hardware", "h100-sxm", "--gpus", "8"]  # fmt: skip


def test_loom_simulate_prices_cp(capsys):
    assert (
        main([*SIM, "--cp", "4", "--attention", "ring", "--seq", "8192", "--global-batch", "4", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["cp"] == 4 and data["plan"]["dp"] == 2 and data["plan"]["attention"] == "ring"
    assert data["cp_bytes_per_layer"] > 0 and data["breakdown"]["cp_comm"] > 0
    assert main([*SIM, "--cp", "4", "--seq", "8192", "--global-batch", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "cp 4 (ulysses attention)" in out and "cp_comm" in out and "per layer and micro-batch" in out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cp", "8", "--tp", "8"], "tp*cp = 8*8 must divide the 32 heads; use --attention ring"),
        (["--cp", "4", "--attention", "ring", "--seq", "8196"], "2*cp = 8 chunks, but seq 8196"),
        (["--attention", "ring"], "give --cp N too"),
        (["--cp", "3"], "not a multiple of tp*pp*cp = 3"),
    ],
)
def test_loom_simulate_explains_cp_it_cannot_price(capsys, flags, message):
    argv = [*SIM[:-2], "--gpus", "64" if "--tp" in flags else "8", *flags]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_a_plan_file_with_cp_is_priced(tmp_path, capsys):
    path = Plan(dp=2, cp=4, attention="ring", precision="bf16").save(tmp_path / "plan.json")
    assert main([*SIM[:-2], "--plan", str(path), "--seq", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["plan"]["cp"], data["plan"]["attention"]) == (4, "ring") and data["cp_bytes_per_layer"] > 0


def test_the_planner_cuts_a_long_sequence_that_fits_no_other_way():
    """64K tokens per sequence on 8 devices under 10 GiB: no plan without cp fits (context=(1,)); the
    search (which tries cp for sequences of 8192 tokens and more) finds one with cp > 1, under the limit."""
    limit = 10 * GIB
    without = search_plans(MODEL, H100, 8, 8, 65536, memory_limit=limit, context=(1,))
    assert without.best is None
    found = search_plans(MODEL, H100, 8, 8, 65536, memory_limit=limit)
    best = found.best
    assert best.plan.cp > 1 and best.result.memory_per_device_gib <= 10
    assert all(c.result.memory_per_device_gib <= 10 for c in found.candidates)
    plan = to_plan(best)
    assert (plan.cp, plan.attention) == (best.plan.cp, best.plan.attention)
    again = simulate(MODEL, plan.parallel_plan(global_batch=8, seq=65536), H100)
    assert again.iteration_s == pytest.approx(best.result.iteration_s)


def test_the_search_tries_cp_inside_pipeline_stages():
    """cp meshes come with every pipeline depth the devices allow, each priced by the simulator as is."""
    found = search_plans(MODEL, H100, 16, 16, 65536, memory_limit=10 * GIB)
    piped = [c for c in found.candidates if c.plan.cp > 1 and c.plan.pp > 1]
    assert piped and all(c.result.memory_per_device_gib <= 10 for c in found.candidates)
    again = simulate(MODEL, to_plan(piped[0]).parallel_plan(global_batch=16, seq=65536), H100.with_size(16))
    assert again.iteration_s == pytest.approx(piped[0].result.iteration_s)
    flat = search_plans(MODEL, H100, 16, 16, 65536, memory_limit=10 * GIB, context_pipelines=False)
    assert any(c.plan.cp > 1 for c in flat.candidates)
    assert not any(c.plan.cp > 1 and c.plan.pp > 1 for c in flat.candidates)


def test_memory_forces_cp_on_a_shorter_sequence():
    """Below 8192 tokens cp is tried only when nothing fits without it, and the search says so."""
    limit = 5.6 * GIB  # the most sharded plan without cp needs 5.86 GiB (tp 4), one with cp 2 5.46
    assert search_plans(MODEL, H100, 8, 8, 4096, memory_limit=limit, context=(1,)).best is None
    found = search_plans(MODEL, H100, 8, 8, 4096, memory_limit=limit)
    assert found.best.plan.cp > 1 and found.best.result.memory_per_device_gib <= 5.6 and found.notes
    roomy = search_plans(MODEL, H100, 8, 8, 4096)  # fits without cp: cp is not searched
    assert roomy.best.plan.cp == 1 and all(c.plan.cp == 1 for c in roomy.candidates) and not roomy.notes


def test_dominated_micro_batches_of_a_cp_mesh_are_pruned():
    """m sequences over cp ranks, m a multiple of cp, hold per rank what m / cp whole sequences on dp * cp
    replicas hold, without the exchanges: pruned, unless ring attention keeps fewer scores than the plain
    kernel (unfused) or dp * cp replicas cannot split the batch."""
    ulysses, ring = Mesh(dp=1, tp=1, pp=1, cp=4), Mesh(dp=1, tp=1, pp=1, cp=4, attention="ring")
    assert micro_batch_sizes(ulysses, 8) == [1, 2]
    assert micro_batch_sizes(ring, 8, flash_attention=True) == [1, 2]
    assert micro_batch_sizes(ring, 8) == [1, 2, 4, 8]
    assert micro_batch_sizes(ulysses, 2) == [1, 2]  # 2 sequences do not spread over 4 replicas


def test_a_configs_cp_is_priced_with_the_collectives_loom_train_is_checked_against():
    """`loom simulate CONFIG.toml` with `[parallel] cp`: the cp bytes per layer are those of
    `Plan.predicted_collectives` (which tests/test_context_parallel_training.py checks against a run)."""
    overrides = ["--parallel.dp", "1", "--parallel.cp", "2", "--parallel.attention", "ring",
                 "--model.positions", "rotary"]  # fmt: skip
    config = load_config("configs/demo.toml", overrides)
    model, priced = config.cost_model(config.train.workers)
    assert (priced.cp, priced.attention) == (2, "ring")
    predicted = config.plan(config.train.workers).predicted_collectives(
        model, global_batch=priced.micro_batch * priced.dp, seq=priced.seq
    )
    # the attention's exchanges (with dp = 1 the gradient sync over dp+cp is named "cp" too)
    over_cp = [c for c in predicted if c.axis == "cp" and c.source.startswith(("ring", "ulysses"))]
    assert over_cp and simulate(model, priced, H100.with_size(4)).cp_bytes_per_layer * model.layers == _sent(
        over_cp
    )


def test_loom_plan_writes_a_cp_plan_that_loom_simulate_prices_again(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama3-8b", "--hardware", "h100-sxm", "--gpus", "8", "--global-batch", "8",
            "--seq", "65536", "--json", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["plan"]["cp"] > 1
    saved = Plan.load(out)
    assert (saved.cp, saved.attention) == (best["plan"]["cp"], best["plan"]["attention"])
    again = ["simulate", "--plan", str(out), "--model", "llama3-8b", "--hardware", "h100-sxm", "--global-batch",
             "8", "--seq", "65536", "--json"]  # fmt: skip
    assert main(again) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["iteration_s"] == pytest.approx(best["result"]["iteration_s"])


def test_megatron_p2p_bytes_per_layer_are_transformer_engines_buffers():
    """Megatron's p2p context parallelism (Transformer Engine's `AttnFuncWithCPAndKVP2P`), seq 8192, bf16,
    8 key/value heads of 128: at cp = 4 a block of keys and values is 2 * 8 * 2048 * 128 * 2 = 8 MiB.
    Forward 3 exchanges of it (24 MiB); backward 4 exchanges of the bf16 double buffer: keys and values
    (8), keys, values and gradients twice (16 each), gradients home (8): 48 MiB, 72 MiB in all (loom's ring:
    112, its gradients travel in fp32). At cp = 2 a block is 16 MiB: forward 1, backward 2 of them."""
    for cp, mib in ((4, 72), (2, 48)):
        plan = _plan(cp, "megatron_p2p", flash_attention=True)
        pieces = piece_costs(MODEL, plan, H100)
        assert list(pieces.layer_cp) == _formula("megatron_p2p", plan)
        assert simulate(MODEL, plan, H100).cp_bytes_per_layer == _sent(pieces.layer_cp) == mib * 2**20
    backward = [c for c in _formula("megatron_p2p", _plan(4, "megatron_p2p", flash_attention=True))
                if c.kind == "send" and c.phase == "backward"]  # fmt: skip
    assert [(c.count, c.nbytes) for c in backward] == [(2, 8 * 2**20), (2, 16 * 2**20)]


def test_megatron_p2p_exchanges_all_hide_behind_the_blocks():
    """Every exchange, the backward's gradients too, starts before a ring step's block and is waited on
    before the next: inside a node all hidden (no cp_comm), with compute free all exposed."""
    plan = _plan(4, "megatron_p2p", flash_attention=True)
    assert simulate(MODEL, plan, H100).breakdown.get("cp_comm", 0) == 0
    free = dataclasses.replace(
        H100.device, peak_flops={"bf16": 1e30}, memory_bandwidth=1e30, kernel_overhead_s=0
    )
    cluster = dataclasses.replace(H100, device=free)
    span = group_span(4, 1, H100.gpus_per_node)
    everything = communication_time(_formula("megatron_p2p", plan), span, cluster)
    layers = MODEL.layers * plan.micro_batches
    assert simulate(MODEL, plan, cluster).breakdown["cp_comm"] == pytest.approx(layers * everything, rel=1e-9)
    # half of a block's time of compute hides half of each exchange
    one = collective_time("send_recv", 8 * 2**20, span, H100)
    kept = exposed_time(_formula("megatron_p2p", plan), span, H100, phase="backward", step_s=one / 2)
    assert kept == pytest.approx(
        2 * one / 2 + 2 * (collective_time("send_recv", 16 * 2**20, span, H100) - one / 2)
    )


def test_megatron_p2p_computes_the_ring_blocks_with_fused_kernels():
    """The same head-tail blocks as loom's ring (forward equal), each block's backward the fused kernel's
    (twice its forward, as every fused attention is priced), where loom's ring recomputes the scores
    (10 / 4 of the forward's attention FLOPs)."""
    p2p, ring = _plan(4, "megatron_p2p", flash_attention=True), _plan(4, "ring", flash_attention=True)
    mine, loom_ring = piece_costs(MODEL, p2p, H100), piece_costs(MODEL, ring, H100)
    assert mine.layer_fwd["matmul"] == loom_ring.layer_fwd["matmul"]
    assert mine.layer_bwd["matmul"] == 2 * mine.layer_fwd["matmul"]
    core = loom_ring.layer_bwd["matmul"] - 2 * loom_ring.layer_fwd["matmul"]  # the ring's recomputation
    assert core > 0
    assert check_plan(MODEL, _plan(4, "megatron_p2p", flash_attention=True, seq=8196), H100) != []


def test_megatron_p2p_needs_fused_attention():
    with pytest.raises(FieldError, match="fused attention kernels per block: set flash_attention"):
        _plan(2, "megatron_p2p")
    assert (
        main([*SIM, "--cp", "2", "--attention", "megatron_p2p", "--seq", "8192", "--global-batch", "4"]) == 1
    )


def test_loom_simulate_prices_megatron_p2p(capsys):
    argv = [*SIM, "--cp", "2", "--attention", "megatron_p2p", "--flash-attention", "--seq", "8192"]
    assert main([*argv, "--global-batch", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["plan"]["cp"], data["plan"]["attention"]) == (2, "megatron_p2p")
    assert data["cp_bytes_per_layer"] == 48 * 2**20
