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
    # NeMo's and Megatron-Bridge's perf recipes overlap tp communication with the GEMMs wherever tp > 1 but
    # in Qwen3-235B's H100 config (tp_comm_overlap=False); the ModelZoo's yaml does not, nor did Megatron-LM
    # of 2021-22 (no Transformer Engine), BLOOM or torchtitan
    cases, _ = published_cases()
    overlapped = {(c.source, c.label) for c in cases if c.plan.overlap_tp_comm}
    assert overlapped == {
        (c.source, c.label)
        for c in cases
        if c.source.startswith("nvidia") and c.plan.tp > 1 and not c.label.startswith("qwen3_235b")
    }
    assert {label.split()[0] for _, label in overlapped} == {"llama3_70b"}


def test_megatron_bridge_qwen3_rows_as_their_perf_configs_ran():
    # experts whole (expert_tensor_parallel_size=1), so Qwen3-235B's ep 32 over tp 2 x dp 16 is simulated;
    # Qwen3-30B-A3B's HybridEP over ep 16 (two nodes) is left out as the ModelZoo's DeepEP rows are
    cases, skipped = published_cases()
    bridge = {c.label: c.plan for c in cases if c.source.startswith("nvidia2026")}
    qwen = {label: plan for label, plan in bridge.items() if label.startswith("qwen3")}
    assert {plan.expert_tp for plan in qwen.values()} == {1}
    assert {label for label in qwen if label.startswith("qwen3_235b")} == {
        "qwen3_235b_a22b 25.11 fp8-cs", "qwen3_235b_a22b 26.04.01 fp8"
    }  # fmt: skip
    assert {"qwen3_30b_a3b 25.11 fp8-cs", "qwen3_30b_a3b 26.02.01 fp8"} <= set(qwen)
    hybrid = {s.label for s in skipped if s.reason.startswith("HybridEP's node-deduplicated dispatch")}
    assert hybrid == {"qwen3_30b_a3b 26.04.01 fp8", "qwen3_30b_a3b 26.06 fp8"}
