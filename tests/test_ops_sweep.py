"""Tier 2: every loom.ops primitive over sampled valid strategies on 2, 4 and 8 ranks equals one device."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from op_cases import PRIMITIVES, check_case, op_case

NO_SHRINK = [Phase.explicit, Phase.generate]  # shrinking re-runs multi-rank cases for minutes
EXAMPLES = {2: 5, 4: 6, 8: 5}  # per primitive: 16 x (5 + 6 + 5) = 256 (primitive, strategy, world size) cases


@pytest.mark.parametrize("world", sorted(EXAMPLES))
@pytest.mark.parametrize("name", PRIMITIVES)
def test_primitive_matches_single_device(dist_run, name, world):
    @settings(
        max_examples=EXAMPLES[world],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op_case(name, world))
    def check(case):
        results = dist_run(world, check_case, case)
        failures = {rank: r for rank, r in enumerate(results) if r}
        assert not failures, f"{case}: {failures}"

    check()
