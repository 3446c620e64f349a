"""Tier 3: one training run carried through four plans by its checkpoints. `loom train`'s job saves under one
plan and world size and resumes under the next: dp=4 at optimizer level 1 -> dp=2 x tp=2 at level 2 -> a
2-stage pipeline with dp=2 at level 1 (states sharded over each stage's replicas) -> a 2-stage pipeline on 2
ranks -> one device (`make test` samples three: dp=2 x tp=2, the dp=2 pipeline, one device). The losses must follow the run that never changed plan (fp32,
relative 1e-5: other meshes sum in other orders), and the final parameters too (tests/equivalence.py)."""

import pytest
from equivalence import RTOL, assert_params_close
from job_cases import job_config

from loom.checkpoint import read_model_tensors
from loom.train.job import run

PER_PLAN = 2
LR = 3e-3
PLANS = [  # (workers, [parallel])
    (4, {"dp": 4, "optimizer_level": 1}),
    (4, {"dp": 2, "tp": 2, "optimizer_level": 2}),
    (4, {"dp": 2, "pp": 2, "microbatches": 2, "optimizer_level": 1}),
    (2, {"dp": 1, "pp": 2, "microbatches": 2, "optimizer_level": 0}),
    (1, {"dp": 1, "optimizer_level": 0}),
]


def _config(tmp_path, name, workers, parallel, steps):
    # a constant learning rate: each run's schedule must not depend on where the chain stops it
    return job_config(
        tmp_path,
        model={"n_heads": 2, "tie_embeddings": False},
        parallel=parallel,
        train={"steps": steps, "global_batch": 8, "workers": workers, "schedule": "constant",
               "warmup_steps": 0, "lr": LR},
        checkpoint={"dir": str(tmp_path / name), "every_steps": PER_PLAN, "keep_last": 10},
    )  # fmt: skip


# make test samples the chain: tensor-parallel shards, then a pipeline, then one device (test-all: every plan)
SAMPLED = [PLANS[1], PLANS[2], PLANS[4]]


@pytest.mark.parametrize(
    "plans", [SAMPLED, pytest.param(PLANS, marks=pytest.mark.slow)], ids=["sampled", "every-plan"]
)
def test_resharding_chain_follows_the_uninterrupted_run(dist_run, tmp_path, plans):
    steps = PER_PLAN * len(plans)
    workers, parallel = plans[0]
    expected = dist_run(workers, run, _config(tmp_path, "straight", workers, parallel, steps))[0]["losses"]
    losses = []
    for index, (workers, parallel) in enumerate(plans):
        config = _config(tmp_path, "chain", workers, parallel, PER_PLAN * (index + 1))
        done = dist_run(workers, run, config)[0]
        assert len(done["losses"]) == PER_PLAN, f"plan {index} resumed at the wrong step"
        losses += done["losses"]
    assert losses == pytest.approx(expected, rel=RTOL)
    final = f"step_{steps:06d}"
    straight, chained = (read_model_tensors(tmp_path / name / final) for name in ("straight", "chain"))
    assert_params_close(chained, straight, lr=LR, steps=steps)  # Lipschitz AdamW (job_cases sets train.eps)
