"""Sampling from a pipeline run: `whole_gpt` gathers the trained model whole on every rank (tier 2:
tp=2 x pp=2, tied embeddings: one device's trained parameters on every rank), and `loom train` with pp > 1 on
the arithmetic task ends with samples and the accuracy, as without pipelines (tier 3: dp=2 x pp=2 at
optimizer level 3, the parameters sharded at rest)."""

import dataclasses

import torch
from equivalence import ADAMW, assert_params_close
from job_cases import job_config
from pipeline_cases import build, reference, train
from test_pipeline_equivalence import CONFIG, STEPS

import loom
from loom.parallel.pipeline import whole_gpt
from loom.train.job import run

TIED = dataclasses.replace(CONFIG, tie_embeddings=True)


def whole_case():
    model, pipe, rows = build(TIED, schedule="1f1b", pp=2, tp=2)
    train(model, pipe, rows, accum=1)
    whole = whole_gpt(model, pipe, loom.current_mesh(), schedule="1f1b")
    return {name: param.detach().clone() for name, param in whole.named_parameters()}


def test_the_whole_model_of_a_pipeline_is_one_devices_on_every_rank(dist_run):
    _, _, expected, _ = reference(TIED, 1)
    for params in dist_run(4, whole_case):
        assert_params_close(params, expected, lr=ADAMW["lr"], steps=STEPS)


def test_loom_train_with_a_pipeline_reports_samples_and_accuracy(dist_run, tmp_path):
    config = job_config(
        tmp_path,
        model={"vocab_size": 256},
        data={"kind": "arithmetic", "path": None, "seq_len": 16},
        parallel={"dp": 2, "pp": 2, "microbatches": 2, "optimizer_level": 3},
        train={"steps": 4, "workers": 4},
    )
    summaries = dist_run(4, run, config)
    samples, accuracy = summaries[0]["samples"], summaries[0]["accuracy"]
    assert len(samples) == 8 and 0.0 <= accuracy <= 1.0
    assert all(prompt.endswith("=") and isinstance(text, str) for prompt, _, text in samples), samples
    for summary in summaries:  # every rank reports what rank 0 decoded
        assert summary["samples"] == samples and summary["accuracy"] == accuracy
    assert torch.isfinite(torch.tensor(summaries[0]["losses"])).all()
