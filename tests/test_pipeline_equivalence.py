"""Tier 2: the reference GPT trained through a pipeline (every schedule, pp=2 and pp=4, and dp x pp) gives
the single-device losses and parameters."""

import pytest
import torch
import torch.distributed as dist

from loom.dist.context import unsharded
from loom.models.gpt import GPT, GPTConfig
from loom.pipeline import Pipeline, gpt_loss, source_names, split_gpt, stage_indices
from loom.pipeline.stages import balanced_partition

STEPS, BATCH, SEQ = 3, 8, 8
CONFIG = GPTConfig(vocab_size=32, d_model=16, n_layers=8, n_heads=2, max_seq_len=SEQ, tie_embeddings=False)


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def _reference():
    model = GPT(CONFIG)
    optimizer, losses = _optimizer(model.parameters()), []
    for ids, targets in _batches():
        loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _groups(dp, pp):
    """pp groups of consecutive ranks, dp groups of ranks pp apart (every rank creates every group)."""
    rank = dist.get_rank()
    pp_groups = [dist.new_group(list(range(d * pp, (d + 1) * pp))) for d in range(dp)]
    dp_groups = [dist.new_group(list(range(s, dp * pp, pp))) for s in range(pp)]
    return pp_groups[rank // pp], dp_groups[rank % pp], rank // pp


def pipeline_case(schedule, dp, pp, virtual, microbatches):
    with unsharded():
        expected, reference = _reference()
        group, dp_group, replica = _groups(dp, pp) if dp > 1 else (None, None, 0)
        model = GPT(CONFIG)
        stages = split_gpt(model, balanced_partition([1] * CONFIG.n_layers, pp * virtual))
        mine = [stages[k] for k in stage_indices(schedule, dist.get_rank(group), pp, virtual)]
        pipe = Pipeline(
            mine,
            schedule=schedule,
            microbatches=microbatches,
            loss_fn=gpt_loss,
            group=group,
            dp_group=dp_group,
        )
        optimizer, losses = _optimizer(pipe.parameters()), []
        for ids, targets in _batches():
            rows = lambda t: t.chunk(dp)[replica]  # noqa: E731
            losses.append(pipe.step(rows(ids), rows(targets)))
            optimizer.step()
            optimizer.zero_grad()
        errors = {
            name: (p.detach() - reference[name]).abs().max().item()
            for stage in mine
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
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        # AdamW moves an entry by up to lr = 3e-3 a step (9e-3 in 3 steps); the runs agree to 0.1% of that
        assert max(errors.values()) < 1e-5, errors
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
