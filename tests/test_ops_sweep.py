"""Tier 2: every loom.ops primitive over sampled valid strategies on 2, 4 and 8 ranks equals one device."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from op_cases import PRIMITIVES, OpCase, check_case, op_case

EXAMPLES = {2: 5, 4: 6, 8: 5}  # per primitive: 16 x (5 + 6 + 5) = 256 (primitive, strategy, world size) cases


def _sampled_cases(name: str, world: int) -> list[OpCase]:
    """The strategies hypothesis draws for `name` on `world` ranks (derandomized: the same every run)."""
    cases = []

    # no shrinking: the cases are checked afterwards, all at once, and a failure reports every failing case
    @settings(max_examples=EXAMPLES[world], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op_case(name, world))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def check_cases(cases: list[OpCase]) -> dict[str, str]:
    """Each case's problem on this rank (cases that match one device are left out)."""
    return {repr(case): problem for case in cases if (problem := check_case(case))}


@pytest.mark.parametrize("world", sorted(EXAMPLES))
@pytest.mark.parametrize("name", PRIMITIVES)
def test_primitive_matches_single_device(dist_run, name, world):
    cases = _sampled_cases(name, world)
    assert cases, "hypothesis drew no strategy"
    # one round trip to the workers for all the cases: 8 ranks on 2 cores wake slowly
    failures = {rank: found for rank, found in enumerate(dist_run(world, check_cases, cases)) if found}
    assert not failures, failures
