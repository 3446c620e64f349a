"""Every published table loads: cases carry their source's half and a kind; left-out rows say why."""

from collections import Counter

from loom.sim.validation.published import A2A_OVERLAP, KINDS, published_cases, source_halves


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
    assert len(titan) == 8
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
    assert {label.split()[0] for _, label in overlapped} == {
        "llama3_70b",
        "llama3-70b",
        "llama3.1_405b",
        "llama2-70b",
        "gpt3-175b",
    }


def test_context_parallel_rows_run_megatrons_p2p_ring():
    # NeMo 24.07 and Megatron-Bridge at cp 2: Megatron-Core's default --cp-comm-type p2p; the CSVs' dp is
    # derived as gpus / (tp * pp * cp), so the plan's devices are the row's GPUs
    cases, _ = published_cases()
    cut = [c for c in cases if c.plan.cp > 1]
    assert len(cut) == 5 and {c.source[:6] for c in cut} == {"nvidia"}
    assert {(c.plan.cp, c.plan.attention, c.plan.flash_attention) for c in cut} == {(2, "megatron_p2p", True)}
    assert all(c.plan.devices == c.cluster.gpus for c in cut)


def test_nemo_rows_take_the_published_architectures():
    # NeMo 24.07 records layers, width and heads; the vocabulary and Llama 2's MLP come from the models'
    # publications (ARCHITECTURES): GPT-2's 50,257-token BPE for GPT-3, Llama 2's 32,000 and 11,008 / 13,824 /
    # 28,672; GPT 5B/20B and Nemotron, whose architectures are not recorded, stay out
    cases, skipped = published_cases()
    nemo = {c.model.name: c.model for c in cases if c.source == "nvidia2024_nemo_perf_summary"}
    assert set(nemo) == {"gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b"}
    assert [(nemo[f"llama2-{s}"].vocab, nemo[f"llama2-{s}"].ffn) for s in ("7b", "13b", "70b")] == [
        (32000, 11008), (32000, 13824), (32000, 28672)
    ]  # fmt: skip
    gpt3 = nemo["gpt3-175b"]
    assert (gpt3.vocab, gpt3.ffn, gpt3.learned_positions, gpt3.tied_embeddings, gpt3.dropout) == (
        50257, 49152, 2048, True, False
    )  # fmt: skip
    assert gpt3.biases and not gpt3.gated_mlp
    left = {s.label.split()[0] for s in skipped if s.source == "nvidia2024_nemo_perf_summary"}
    assert left == {"gpt3-5b", "gpt3-20b", "nemotron-8b", "nemotron-22b", "nemotron-340b"}


def test_modelzoo_a2a_row_leaves_its_ends_to_embedding_and_loss():
    # tp 2 / pp 32 / virtual 3: 96 virtual stages for 94 layers, the yaml counting embedding and loss as layers
    cases, _ = published_cases()
    (a2a,) = [c for c in cases if c.source.startswith("yan2025") and c.plan.pp == 32]
    assert a2a.plan.stage_layers == (0, *[1] * 94, 0) and a2a.plan.virtual_stages == 96


def test_modelzoo_deepep_rows_run_deepeps_dispatch():
    # the `dispatcher` column: DeepEP rows send a token once per destination rank (across nodes once per
    # node), A2A rows once per routed expert; the row published with 1F1B expert-communication overlap stays
    # out (loom waits for each dispatch where it is issued)
    cases, skipped = published_cases()
    zoo = [c for c in cases if c.source.startswith("yan2025")]
    assert {(c.plan.pp, c.plan.ep, c.plan.moe_dispatcher) for c in zoo} == {
        (8, 32, "deepep"), (1, 8, "deepep"), (8, 8, "deepep"), (32, 8, "all_to_all")
    }  # fmt: skip
    # the same rule where a Megatron-Bridge release's config set `moe_a2a_overlap` (every Qwen3-235B H100 run,
    # Qwen3-30B-A3B's 25.11)
    overlapped = sorted((s.source[:8], s.label) for s in skipped if s.reason == A2A_OVERLAP)
    assert overlapped[:3] == [
        ("nvidia20", "qwen3_235b_a22b 25.11 fp8-cs"), ("nvidia20", "qwen3_235b_a22b 26.04.01 fp8"),
        ("nvidia20", "qwen3_30b_a3b 25.11 fp8-cs"),
    ]  # fmt: skip
    assert [source for source, _ in overlapped[3:]] == ["yan2025_"] and "1F1B" in A2A_OVERLAP
    # elsewhere only Megatron-Bridge's Qwen3-30B-A3B runs DeepEP (26.02) or Hybrid-EP (26.02.01 on)
    flex = {
        c.label for c in cases if not c.source.startswith("yan2025") and c.plan.moe_dispatcher != "all_to_all"
    }
    assert flex == {"qwen3_30b_a3b 26.02.01 fp8", "qwen3_30b_a3b 26.04.01 fp8", "qwen3_30b_a3b 26.06 fp8"}


def test_megatron_bridge_qwen3_rows_as_their_perf_configs_ran():
    # experts whole (expert_tensor_parallel_size=1); Qwen3-235B's runs left out (their configs overlap expert
    # exchanges across micro-batches); Qwen3-30B-A3B's Hybrid-EP over ep 16 (two nodes) dispatches once per destination node, as DeepEP
    # (`moe_dispatcher = "hybridep"`: sent as DeepEP's, its own kernels permuting the rows)
    cases, skipped = published_cases()
    bridge = {c.label: c.plan for c in cases if c.source.startswith("nvidia2026")}
    qwen = {label: plan for label, plan in bridge.items() if label.startswith("qwen3")}
    assert {plan.expert_tp for plan in qwen.values()} == {1}
    assert not [label for label in qwen if label.startswith("qwen3_235b")]  # expert exchanges overlapped
    assert "qwen3_30b_a3b 26.02.01 fp8" in qwen
    assert (qwen["qwen3_30b_a3b 26.06 fp8"].ep, qwen["qwen3_30b_a3b 26.06 fp8"].moe_dispatcher) == (
        16,
        "hybridep",
    )
    # 25.09: precision not stated; 25.11: its expert exchanges overlapped across micro-batches
    assert [s.label for s in skipped if "qwen3_30b" in s.label] == [
        "qwen3_30b_a3b 25.11 fp8-cs",
        "qwen3_30b_a3b 25.09",
    ]


def test_moe_rows_sync_host_and_device_as_their_systems_dispatch():
    # every simulated MoE row is dropless without CUDA graphs (the per-expert counts read on the host in each MoE
    # layer); Megatron-Bridge 25.09's "(tokendrop)" rows pad to capacity (left out: no precision stated)
    from loom.sim.validation.published import BRIDGE, _bridge_sync, _rows

    cases, _ = published_cases()
    assert {c.plan.moe_sync for c in cases if c.model.is_moe} == {"dropless"}
    syncs = {(row["model"], row["release"]): _bridge_sync(row) for row in _rows(BRIDGE) if row["experts"]}
    assert {key for key, sync in syncs.items() if sync == "token_drop"} == {
        ("qwen3_30b_a3b", "25.09"), ("qwen3_235b_a22b", "25.09")
    }  # fmt: skip
