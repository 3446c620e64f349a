"""Every published table loads: cases carry their source's half and a kind; left-out rows say why."""

from collections import Counter

from loom.sim.validation.published import KINDS, published_cases, source_halves


def test_every_row_is_a_case_or_left_out_with_a_reason():
    cases, skipped = published_cases()
    halves = source_halves()
    assert len(cases) + len(skipped) == 337 and len(cases) >= 40
    assert all(s.reason for s in skipped)
    assert {c.half for c in cases} == {"fit", "held-out"} and all(c.kind in KINDS for c in cases)
    for half in ("fit", "held-out"):
        kinds = Counter(c.kind for c in cases if c.half == half)
        assert kinds["fsdp"] > 0 and kinds["moe"] > 0, half
    # the half is the source's, from split_by_source.csv
    assert all(halves[next(s for s in halves if s.startswith(c.source))] == c.half for c in cases)


def test_uneven_stages_follow_the_light_ends_rule():
    cases, _ = published_cases()
    bloom = next(c for c in cases if c.source.startswith("bigscience") and c.model.layers == 70)
    assert bloom.plan.stage_layers == (5, *[6] * 10, 5)  # embedding and head take a layer's slot each


def test_torchtitan_rows_run_fsdp2_in_bf16_reduced_in_fp32():
    # torchtitan's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and FSDP2's copy-in/copy-out
    cases, _ = published_cases()
    titan = [c for c in cases if c.source.startswith("torchtitan")]
    assert len(titan) == 6
    assert {(c.plan.dtype, c.plan.grad_precision, c.plan.grad_accumulation) for c in titan} == {
        ("bf16", "fp32", "copy_in_out")
    }


def test_torchtitan_selective_op_rows_are_priced_as_its_op_level_policy():
    # `selective_ac_option = "op"`: every second mm recomputed (TransformerConfig.op_sac_matmuls), not
    # Korthikanti's attention-core recomputation
    cases, _ = published_cases()
    titan = {c.label: c.plan.recompute for c in cases if c.source.startswith("torchtitan")}
    assert {label for label, policy in titan.items() if policy == "torchtitan_op"} == {
        label for label in titan if " selective op " in label
    }
    assert len([p for p in titan.values() if p == "torchtitan_op"]) == 3


def test_tp_comm_overlap_is_set_where_the_system_ran_it():
    # NeMo's and Megatron-Bridge's perf recipes overlap tp communication with the GEMMs wherever tp > 1; the
    # ModelZoo's yaml does not, nor did Megatron-LM of 2021-22 (no Transformer Engine), BLOOM or torchtitan
    cases, _ = published_cases()
    overlapped = {(c.source, c.label) for c in cases if c.plan.overlap_tp_comm}
    assert overlapped == {
        (c.source, c.label) for c in cases if c.source.startswith("nvidia") and c.plan.tp > 1
    }
    assert {label.split()[0] for _, label in overlapped} == {"llama3_70b", "llama3-70b", "llama3.1_405b"}


def test_context_parallel_rows_run_megatrons_p2p_ring():
    # NeMo 24.07 and Megatron-Bridge at cp 2: Megatron-Core's default --cp-comm-type p2p; the CSVs' dp is
    # derived as gpus / (tp * pp * cp), so the plan's devices are the row's GPUs
    cases, _ = published_cases()
    cut = [c for c in cases if c.plan.cp > 1]
    assert len(cut) == 5 and {c.source[:6] for c in cut} == {"nvidia"}
    assert {(c.plan.cp, c.plan.attention, c.plan.flash_attention) for c in cut} == {(2, "megatron_p2p", True)}
    assert all(c.plan.devices == c.cluster.gpus for c in cut)
