"""Tier 2: the reference GPT trained through a pipeline (every schedule, pp=2 and pp=4, and dp x pp) gives
the single-device losses and parameters."""

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, adamw, param_atol

import loom
from loom.dist.context import unsharded
from loom.models.gpt import GPT, GPTConfig
from loom.parallel.pipeline import Pipeline, gpt_loss, gpt_pipeline, source_names, split_gpt
from loom.parallel.pipeline.stages import balanced_partition

STEPS, BATCH, SEQ = 3, 8, 8
CONFIG = GPTConfig(vocab_size=32, d_model=16, n_layers=8, n_heads=2, max_seq_len=SEQ, tie_embeddings=False)


def batches():
    """The runs' data: STEPS batches of (ids, targets), the same in every process."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def optimizer(params):
    """The runs' optimizer: AdamW whose steps are Lipschitz in the gradient (tests/equivalence.py)."""
    return adamw(params)


def _reference():
    model = GPT(CONFIG)
    adamw, losses = optimizer(model.parameters()), []
    for ids, targets in batches():
        loss = model(ids, targets)
        loss.backward()
        adamw.step()
        adamw.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def pipeline_case(schedule, dp, pp, virtual, microbatches):
    mesh = loom.init({"pp": pp, "dp": dp})
    with unsharded():
        expected, reference = _reference()
        replica = mesh.dp_rank()
        model = GPT(CONFIG)
        pipe = gpt_pipeline(model, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual)
        adamw, losses = optimizer(pipe.parameters()), []
        for ids, targets in batches():
            rows = lambda t: t.chunk(dp)[replica]  # noqa: E731
            losses.append(pipe.step(rows(ids), rows(targets)))
            adamw.step()
            adamw.zero_grad()
    errors = {
        name: (p.detach() - reference[name]).abs().max().item()
        for stage in pipe.modules
        for name, p in zip(source_names(model, stage), stage.parameters(), strict=True)
    }
    return expected, losses, errors


CASES = [  # (schedule, dp, pp, virtual stages per rank, micro-batches)
    ("gpipe", 1, 2, 1, 4),
    ("1f1b", 1, 2, 1, 4),
    ("interleaved", 1, 2, 2, 4),
    ("zero_bubble", 1, 2, 2, 4),
    ("zbv", 1, 2, 2, 4),
    ("gpipe", 1, 4, 1, 4),
    ("1f1b", 1, 4, 1, 8),
    ("interleaved", 1, 4, 2, 4),
    ("zero_bubble", 1, 4, 1, 4),
    ("zero_bubble", 1, 4, 2, 8),
    ("zbv", 1, 4, 2, 4),
    ("1f1b", 2, 2, 1, 2),
    ("zbv", 2, 2, 2, 4),
]


@pytest.mark.parametrize(("schedule", "dp", "pp", "virtual", "microbatches"), CASES)
def test_pipeline_training_matches_one_device(dist_run, schedule, dp, pp, virtual, microbatches):
    results = dist_run(dp * pp, pipeline_case, schedule, dp, pp, virtual, microbatches)
    for expected, losses, errors in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        assert max(errors.values()) <= param_atol(ADAMW["lr"], STEPS), errors
    trained = set().union(*(errors for _, _, errors in results))
    assert len(trained) == len(dict(GPT(CONFIG).named_parameters())), "every parameter lives on some stage"


def fewer_microbatches_case():
    with unsharded():
        stages = split_gpt(GPT(CONFIG), balanced_partition([1] * CONFIG.n_layers, 2))
        try:
            Pipeline([stages[dist.get_rank()]], schedule="1f1b", microbatches=1, loss_fn=gpt_loss)
        except ValueError as error:
            return str(error)
    return "no error"


def test_fewer_microbatches_than_stages_is_an_error(dist_run):
    for message in dist_run(2, fewer_microbatches_case):
        assert "1 micro-batches for 2 pipeline stages" in message
