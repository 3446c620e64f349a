"""Tier 1: the whole-step simulator against published runs, its speed, its reasons, and its monotonicity."""

from __future__ import annotations

import json
import statistics

import pytest

from loom.cost.hardware import get_cluster
from loom.cost.layer import piece_costs
from loom.cost.plan import ParallelPlan
from loom.cost.traffic import stage_gather_bytes, stage_stream_bytes
from loom.sim import PlanError, check_plan, get_model, load_model_config, simulate
from loom.sim.validation import cases, narayanan_interleave


def _errors() -> list[float]:
    return [getattr(simulate(c.model, c.plan, c.cluster), c.metric) / c.published - 1 for c in cases()]


def test_validation_tables_within_acceptance():
    errors = [abs(e) for e in _errors()]
    assert len(errors) == 18
    assert statistics.mean(errors) <= 0.10
    assert max(errors) <= 0.20


def test_every_published_run_fits_in_80_gib():
    for case in cases():
        result = simulate(case.model, case.plan, case.cluster)
        assert result.fits, (case.label, result.memory_per_device_gib)


def test_narayanan_assumption_is_one_rule():
    assert [narayanan_interleave(n) for n in (24, 15, 10, 6, 3, 2)] == [2, 3, 2, 2, 3, 2]


def test_gpt3_on_1024_h100_simulates_quickly():
    plan = ParallelPlan(
        dp=16,
        tp=8,
        pp=8,
        interleave=3,
        global_batch=1536,
        seq=2048,
        recompute="selective",
        sequence_parallel=True,
    )
    # its speed is measured by benchmarks/simulator_validation.py (tests never assert on time)
    result = simulate(get_model("gpt3-175b"), plan, get_cluster("h100-sxm", gpus=1024))
    assert result.fits and 0.2 < result.mfu < 0.7


BASE = ParallelPlan(
    dp=2, tp=8, pp=4, global_batch=64, seq=4096, recompute="selective", sequence_parallel=True
)
LLAMA = get_model("llama3-70b")
H100 = get_cluster("h100-sxm", gpus=64)


def test_impossible_plans_give_reasons():
    with pytest.raises(PlanError) as info:
        simulate(LLAMA, BASE.replace(pp=3, global_batch=60), H100)
    assert any("devices" in r for r in info.value.reasons) and any("layers" in r for r in info.value.reasons)
    assert check_plan(LLAMA, BASE, H100) == []
    assert any("ep=2" in r for r in check_plan(LLAMA, BASE.replace(ep=2), H100))


def test_memory_overflow_is_reported_not_hidden():
    result = simulate(get_model("llama3-405b"), ParallelPlan(dp=64, global_batch=64, seq=8192), H100)
    assert not result.fits and "GiB" in result.reason


def test_recompute_trades_time_for_memory():
    results = {r: simulate(LLAMA, BASE.replace(recompute=r), H100) for r in ("none", "selective", "full")}
    assert results["none"].iteration_s < results["selective"].iteration_s < results["full"].iteration_s
    assert (
        results["none"].memory_per_device_gib
        > results["selective"].memory_per_device_gib
        > results["full"].memory_per_device_gib
    )
    assert results["full"].hfu > results["full"].mfu


def test_optimizer_levels_shrink_memory():
    memory = [
        simulate(LLAMA, BASE.replace(optimizer_level=level), H100).memory_per_device_gib for level in range(4)
    ]
    assert memory[0] > memory[1] > memory[2] > memory[3]


def test_more_micro_batches_shrink_the_bubble():
    small = simulate(LLAMA, BASE.replace(global_batch=16), H100).bubble_fraction
    large = simulate(LLAMA, BASE.replace(global_batch=256), H100).bubble_fraction
    assert large < small


def test_overlapped_gradient_sync_is_not_slower():
    plan = BASE.replace(pp=1, dp=8, global_batch=64)
    assert (
        simulate(LLAMA, plan, H100).iteration_s
        <= simulate(LLAMA, plan.replace(overlap_grad_sync=False), H100).iteration_s
    )


def test_blocking_pipeline_sends_are_priced_and_shown():
    overlapped = simulate(LLAMA, BASE, H100)
    blocking = simulate(LLAMA, BASE.replace(overlap_p2p=False), H100)
    assert overlapped.breakdown["pp_comm"] == 0.0 < blocking.breakdown["pp_comm"]
    assert blocking.iteration_s > overlapped.iteration_s
    assert sum(blocking.breakdown.values()) == pytest.approx(blocking.iteration_s, rel=1e-6)


def test_scatter_gather_sends_a_tensor_parallel_share_and_gathers_it():
    model, cluster = get_model("gpt3-175b"), get_cluster("a100-80gb", gpus=16)
    whole = ParallelPlan(dp=1, tp=8, pp=2, global_batch=8, seq=2048, recompute="full")
    split = whole.replace(scatter_gather_p2p=True)
    assert stage_stream_bytes(model, split) * 8 == stage_stream_bytes(model, whole)
    assert stage_gather_bytes(model, split) == stage_stream_bytes(model, whole)
    assert stage_gather_bytes(model, whole) == 0
    # with sequence parallelism the layers take the cut stream as it comes: nothing to gather
    assert stage_gather_bytes(model, split.replace(recompute="selective", sequence_parallel=True)) == 0
    # stages on different nodes: an eighth over InfiniBand and a gather over NVLink beat the whole over InfiniBand
    assert piece_costs(model, split, cluster).p2p_s < piece_costs(model, whole, cluster).p2p_s


def test_mixture_of_experts_with_expert_parallelism():
    model = get_model("mixtral-8x7b")
    plan = ParallelPlan(
        dp=32,
        tp=2,
        ep=8,
        global_batch=256,
        seq=4096,
        recompute="selective",
        sequence_parallel=True,
        flash_attention=True,
    )
    result = simulate(model, plan, H100)
    assert result.fits and result.breakdown["ep_comm"] > 0
    assert result.memory_per_device_gib < simulate(model, plan.replace(ep=1), H100).memory_per_device_gib


def test_breakdown_adds_up_to_the_iteration():
    result = simulate(LLAMA, BASE, H100)
    assert sum(result.breakdown.values()) == pytest.approx(result.iteration_s, rel=1e-6)


def test_preset_parameter_counts():
    billions = {
        name: get_model(name).parameter_count() / 1e9
        for name in ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b")
    }
    assert billions == pytest.approx(
        {"gpt3-175b": 174.6, "llama3-8b": 8.03, "llama3-70b": 70.55, "llama3-405b": 405.85}, rel=2e-3
    )


def test_model_config_files(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text('[model]\nname = "tiny"\nlayers = 4\nhidden = 256\nheads = 4\nvocab = 1000\n')
    assert load_model_config(toml).layers == 4
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "intermediate_size": 14336, "vocab_size": 128256}))  # fmt: skip
    assert load_model_config(hf).parameter_count() == get_model("llama3-8b").parameter_count()
    bad = tmp_path / "bad.toml"
    bad.write_text("layerz = 3\n")
    with pytest.raises(ValueError, match="unknown model fields"):
        load_model_config(bad)
