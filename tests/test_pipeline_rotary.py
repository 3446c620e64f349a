"""Tier 2: a Llama-style GPT (rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied head)
through a pipeline gives one device's losses, gradient norms, evaluation loss and parameters: pp=2 on 2
ranks (a zero-bubble schedule: the weight-gradient passes apart), and dp=2 x tp=2 x pp=2 on 8 ranks with
sequence parallelism and two stages per rank. Four blocks: one per stage (8 ranks share 2 cores here)."""

import dataclasses

import pytest
from pipeline_cases import assert_matches_one_device, pipeline_case
from test_pipeline_equivalence import CONFIG

LLAMA = dataclasses.replace(
    CONFIG, n_layers=4, n_heads=4, n_kv_heads=2, norm="rmsnorm", positions="rotary", mlp="swiglu"
)
ACCUM = 2

CASES = [
    dict(schedule="zero_bubble", pp=2, virtual=2),
    # 8 ranks: make test-all (make test samples rotary pipelines on 2 ranks, and with cp on 4)
    pytest.param(
        dict(schedule="interleaved", pp=2, dp=2, tp=2, virtual=2, sequence_parallel=True),
        marks=pytest.mark.slow,
        id="interleaved-dp2-tp2-pp2",
    ),
]


@pytest.mark.parametrize(
    "layout", CASES, ids=lambda c: f"{c['schedule']}-dp{c.get('dp', 1)}-tp{c.get('tp', 1)}-pp{c['pp']}"
)
def test_a_rotary_gpt_through_a_pipeline_matches_one_device(dist_run, layout):
    ranks = layout["pp"] * layout.get("dp", 1) * layout.get("tp", 1)
    results = dist_run(ranks, pipeline_case, LLAMA, ACCUM, **layout)
    assert_matches_one_device(results, LLAMA, ACCUM)
