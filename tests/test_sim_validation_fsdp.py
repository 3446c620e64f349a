"""The FSDP rows (MosaicML llm-foundry) load as simulator cases and every one of them simulates."""

from collections import Counter

from loom.sim import simulate
from loom.sim.validation import fsdp_cases, read_rows


def test_every_fsdp_row_is_a_case_that_simulates():
    rows = read_rows("mosaicml2024")
    cases = fsdp_cases()
    assert len(cases) == sum(r["activation_cpu_offload"] != "True" for r in rows) == 209
    assert Counter(c.plan.optimizer_level for c in cases) == {3: 203, 2: 6}
    first, row = cases[0], rows[0]
    assert first.plan.dp == first.cluster.gpus == int(row["gpus"]) and first.plan.tp == first.plan.pp == 1
    assert first.published == float(row["tokens_per_s_per_gpu"]) * int(row["gpus"])
    # MPT as benchmarked (biases, learned positions, tied head) has exactly the published parameter count
    kept = [r for r in rows if r["activation_cpu_offload"] != "True"]
    assert [c.model.parameter_count() for c in cases] == [int(r["num_params"]) for r in kept]
    # FSDP1's per-micro-batch gradient path, unit by unit on its full-shard and SHARD_GRAD_OP rows alike
    assert {(c.plan.optimizer_level, c.plan.grad_accumulation) for c in cases} == {
        (3, "flat_copy"),
        (2, "flat_copy"),
    }
    assert all(c.plan.unit_sharded for c in cases)
    for case in cases:
        result = simulate(case.model, case.plan, case.cluster)
        assert result.tokens_per_s > 0 and result.fits, case.label
