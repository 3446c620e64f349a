"""Shared pieces of the pipeline equivalence tests that follow `equivalence`'s rule (Lipschitz AdamW):
one device's run of a GPT config, the same run through the `Trainer` on a mesh, and the comparison."""

from __future__ import annotations

import functools

import torch
from equivalence import ADAMW, RTOL, adamw, assert_params_close
from test_pipeline_equivalence import STEPS, batches

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.pipeline import Pipeline, gpt_pipeline, source_names
from loom.train.data import micro_batches
from loom.train.trainer import Trainer


@functools.cache
def reference(config: GPTConfig, accum: int) -> tuple:
    """One device: losses, gradient norms, parameters after `STEPS` steps, and the evaluation loss of the
    first batch (run in the test process)."""
    model = GPT(config)
    trainer = Trainer(model, adamw(model.parameters()), grad_accum=accum)
    metrics = [trainer.train_step(micro_batches(batch, accum)) for batch in batches()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], params, trainer.evaluate([batches()[0]])


def build(
    config: GPTConfig, *, schedule: str, pp: int, dp: int = 1, tp: int = 1, virtual: int = 1,
    microbatches: int = 2, sequence_parallel: bool = False, bucket_mb: float = 25.0,
) -> tuple[GPT, Pipeline, list[tuple]]:  # fmt: skip
    """Inside a worker: the GPT on the meta device, this rank's pipeline, and this replica's rows of the
    batches."""
    mesh = loom.init({"pp": pp, "dp": dp} | ({"tp": tp} if tp > 1 else {}))
    with torch.device("meta"):  # as `loom train` builds it: each rank materialises its stages only
        model = GPT(config, Strategies(dp, tp, sequence_parallel))
    pipe = gpt_pipeline(
        model, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual, bucket_mb=bucket_mb
    )
    rows = [tuple(t.chunk(dp)[mesh.dp_rank()] for t in batch) for batch in batches()]
    return model, pipe, rows


def train(model: GPT, pipe: Pipeline, rows: list[tuple], *, accum: int, level: int = 0) -> tuple:
    """`STEPS` steps of the `Trainer` at optimizer `level`: losses, gradient norms, this rank's whole
    parameters by the model's names (read inside `full_parameters` at level 3), the evaluation loss."""
    optimizer = make_optimizer(pipe, torch.optim.AdamW, level, **ADAMW)
    trainer = Trainer(pipe, optimizer, grad_accum=accum)
    metrics = [trainer.train_step(micro_batches(batch, accum)) for batch in rows]
    with pipe.full_parameters():
        params = {  # whole parameters (a tensor-parallel stage's shards gathered over its stage mesh)
            name: loom.full(p.detach()).clone()
            for stage in pipe.modules
            for name, p in zip(source_names(model, stage), stage.parameters(), strict=True)
        }
    evaluation = trainer.evaluate([rows[0]]) if pipe.kind.placement != "v" else None  # zbv: no eval
    return [m.loss for m in metrics], [m.grad_norm for m in metrics], params, evaluation


def pipeline_case(config: GPTConfig, accum: int, level: int = 0, **layout) -> tuple:
    """A worker's whole run: `build`, then `train`."""
    return train(*build(config, **layout), accum=accum, level=level)


def assert_matches_one_device(results: list[tuple], config: GPTConfig, accum: int) -> None:
    """Every rank's losses and gradient norms (rtol `RTOL`) and evaluation loss are one device's; the
    parameters, gathered from every rank, too (`assert_params_close`)."""
    expected, expected_norms, reference_params, expected_eval = reference(config, accum)
    params = {}
    for losses, norms, rank_params, evaluation in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0)
        if evaluation is not None:
            torch.testing.assert_close(evaluation, expected_eval, rtol=RTOL, atol=0)
        params.update(rank_params)
    assert_params_close(params, reference_params, lr=ADAMW["lr"], steps=STEPS)
