"""Tier 1: the cost model's formulas reproduce the published ones exactly (FLOPs, parameters, ZeRO, activations)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.cost.hardware import get_cluster
from loom.cost.memory import (
    korthikanti_activation_bytes,
    layer_activation_bytes,
    model_state_bytes,
    state_bytes,
)
from loom.cost.plan import LOOM_SYSTEM, ParallelPlan
from loom.cost.transformer import (
    TransformerConfig,
    megatron_model_flops,
    megatron_parameter_count,
    megatron_recompute_flops,
)
from loom.sim.memory import stage_memory, stage_parameters
from loom.sim.presets import get_model
from loom.sim.validation import cases

VALIDATION_MODELS = sorted({(c.model.layers, c.model.hidden, c.model.heads) for c in cases()})


def gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 51200) -> TransformerConfig:
    return TransformerConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, learned_positions=seq)


@pytest.mark.parametrize(("layers", "hidden", "heads"), VALIDATION_MODELS)
def test_flops_match_the_megatron_formulas_for_every_validation_model(layers, hidden, heads):
    model, batch, seq = gpt(layers, hidden, heads), 512, 2048
    assert model.model_flops(batch, seq) == pytest.approx(
        megatron_model_flops(batch, seq, layers, hidden, 51200), rel=1e-12
    )
    full = model.hardware_flops(batch, seq, "full")
    assert full == pytest.approx(megatron_recompute_flops(batch, seq, layers, hidden, 51200), rel=1e-12)


@pytest.mark.parametrize(("layers", "hidden", "heads"), VALIDATION_MODELS)
def test_parameter_count_matches_the_narayanan_formula_plus_the_final_norm(layers, hidden, heads):
    model = gpt(layers, hidden, heads)
    # the formula leaves out the final LayerNorm (2h); everything else is counted identically
    assert model.parameter_count() - 2 * hidden == pytest.approx(
        megatron_parameter_count(2048, layers, hidden, 51200), rel=1e-12
    )


def test_published_parameter_counts_round_to_the_table():
    for case in cases():
        if case.source == "narayanan2021":
            assert model_billions(case.model) == pytest.approx(float(case.label.rstrip("B")), rel=0.03)


def model_billions(model: TransformerConfig) -> float:
    return model.parameter_count() / 1e9


def test_zero_paper_figure_1_example():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, Nd = 64, K = 12
    psi, nd = 7.5e9, 64
    expected = {0: 120e9, 1: 4 * psi + 12 * psi / nd, 2: 2 * psi + 14 * psi / nd, 3: 16 * psi / nd}
    for level, value in expected.items():
        assert model_state_bytes(psi, level, nd) == value
    assert round(model_state_bytes(psi, 1, nd) / 1e9, 1) == 31.4
    assert round(model_state_bytes(psi, 2, nd) / 1e9, 1) == 16.6
    assert round(model_state_bytes(psi, 3, nd) / 1e9, 2) == 1.88


@given(st.floats(1, 1e12), st.integers(1, 4096))
def test_zero_levels_exact_formulas(psi, nd):
    assert model_state_bytes(psi, 0, nd) == pytest.approx(16 * psi)
    assert model_state_bytes(psi, 1, nd) == pytest.approx(4 * psi + 12 * psi / nd)
    assert model_state_bytes(psi, 2, nd) == pytest.approx(2 * psi + 14 * psi / nd)
    assert model_state_bytes(psi, 3, nd) == pytest.approx(16 * psi / nd)


def test_model_states_per_parameter_by_where_the_master_weights_live():
    """The simulator's model states per parameter. Master weights in the optimizer: Megatron-LM's documented
    bytes, fp16 parameters and gradients 20 (4 + 16/d sharded), bf16 parameters with fp32 gradients 18
    (6 + 12/d). Master weights as the parameters (loom, torch's autocast, FSDP): 4 + 4 + 8 = 16, sharded
    level by level."""
    model = get_model("gpt3-175b")
    d = 8
    plan = ParallelPlan(
        dp=d, tp=8, pp=16, global_batch=64, seq=2048, dtype="fp16", master_weights="optimizer"
    )
    psi = sum(stage_parameters(model, plan, 0))

    def per_parameter(**fields) -> float:
        states = stage_memory(model, plan.replace(**fields), get_cluster("a100-80gb"), 0, in_flight=1)
        return states["model_states"] / psi

    assert per_parameter() == pytest.approx(20)
    assert per_parameter(optimizer_level=1) == pytest.approx(4 + 16 / d)
    assert per_parameter(dtype="bf16", grad_dtype="fp32") == pytest.approx(18)
    assert per_parameter(dtype="bf16", grad_dtype="fp32", optimizer_level=1) == pytest.approx(6 + 12 / d)
    assert per_parameter(optimizer_level=3) == pytest.approx(20 / d)
    assert per_parameter(dtype="fp32") == pytest.approx(16)  # fp32 parameters are their own master weights
    # loom's runtime: fp32 parameters; at levels 1-2 its optimizer steps an fp32 copy of each rank's chunk
    ours = {"master_weights": "parameters", "dtype": "bf16"}
    assert ParallelPlan(global_batch=1, seq=1).master_weights == LOOM_SYSTEM["master_weights"] == "parameters"
    assert [per_parameter(**ours, optimizer_level=level) for level in range(4)] == pytest.approx(
        [16, 8 + 12 / d, 4 + 16 / d, 16 / d]
    )
    assert state_bytes(plan.replace(**ours)) == {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
    with pytest.raises(ValueError, match="master_weights"):
        plan.replace(master_weights="gpu")


def test_zero_rejects_unknown_levels():
    with pytest.raises(ValueError, match="level"):
        model_state_bytes(1e9, 4, 8)


@given(
    s=st.sampled_from([512, 1024, 2048, 4096]),
    b=st.integers(1, 8),
    heads_t=st.sampled_from([(16, 1), (32, 2), (64, 8), (96, 8), (128, 8), (160, 8)]),
    head_dim=st.sampled_from([64, 128]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    sp=st.booleans(),
)
def test_structural_activations_equal_korthikanti_closed_forms(s, b, heads_t, head_dim, recompute, sp):
    heads, t = heads_t
    h = heads * head_dim
    model = gpt(24, h, heads, seq=s)
    ours = layer_activation_bytes(model, s, b, t, recompute=recompute, sequence_parallel=sp)
    theirs = korthikanti_activation_bytes(s, b, h, heads, t, recompute=recompute, sequence_parallel=sp)
    assert math.isclose(ours, theirs, rel_tol=1e-12)


def test_korthikanti_closed_forms_by_hand():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_activation_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_activation_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert korthikanti_activation_bytes(s, b, h, a, t, sequence_parallel=True) == sbh / t * (
        34 + 5 * a * s / h
    )
    assert korthikanti_activation_bytes(s, b, h, a, t, recompute="selective") == sbh * (10 + 24 / t)
    assert (
        korthikanti_activation_bytes(s, b, h, a, t, recompute="selective", sequence_parallel=True)
        == 34 * sbh / t
    )
    assert korthikanti_activation_bytes(s, b, h, a, t, recompute="full") == 2 * sbh


def test_llama_style_layers_store_less_than_gpt_with_gqa_and_no_dropout():
    gpt_like = gpt(32, 4096, 32)
    llama_like = gpt_like.replace(kv_heads=8, dropout=False)
    assert layer_activation_bytes(llama_like, 4096, 1, 1) < layer_activation_bytes(gpt_like, 4096, 1, 1)
    flash = layer_activation_bytes(llama_like, 4096, 1, 1, flash_attention=True)
    assert flash == layer_activation_bytes(llama_like, 4096, 1, 1, recompute="selective")


def test_moe_flops_count_only_routed_experts():
    dense = TransformerConfig(layers=2, hidden=1024, heads=8, vocab=1000)
    moe = dense.replace(experts=8, top_k=2)
    extra = (
        moe.layer_forward_flops_per_token(128)["dense"] - dense.layer_forward_flops_per_token(128)["dense"]
    )
    assert extra == 2 * 2 * 1024 * 4096 + 2 * 1024 * 8  # a second expert's MLP plus the router
    assert moe.parameter_count() > moe.active_parameter_count() > dense.parameter_count()
