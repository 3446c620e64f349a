"""Tier 2: training the reference GPT on 4 ranks gives the single-device losses, gradient norms and
parameters (AdamW with Lipschitz steps; one case with the default eps: tests/equivalence.py)."""

import functools

import pytest
import torch
from equivalence import ADAMW, RTOL, assert_adamw_params_close, assert_params_close

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.recompute import recompute
from loom.train import Trainer

STEPS, GLOBAL_BATCH, SEQ = 5, 8, 16
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _train(model, batches, accum, rows, level=0, eps=ADAMW["eps"]):
    optimizer = make_optimizer(model, torch.optim.AdamW, level, **(ADAMW | {"eps": eps}))
    trainer = Trainer(model, optimizer, grad_accum=accum, clip_grad_norm=0.5)
    results = []
    for ids, targets in batches:
        ids, targets = rows(ids), rows(targets)
        micro = list(zip(ids.chunk(accum), targets.chunk(accum), strict=True))
        results.append(trainer.train_step(micro))
    return [r.loss for r in results], [r.grad_norm for r in results]


@functools.cache
def _reference(accum: int, eps: float):
    """One device's losses, gradient norms and parameters (computed once per test run, in the test process:
    recomputation changes no result, so one reference serves every policy)."""
    model = GPT(CONFIG)
    losses, norms = _train(model, _batches(), accum, lambda t: t, eps=eps)
    return losses, norms, {name: p.detach() for name, p in model.named_parameters()}


def train_case(dp, tp, sequence_parallel, policy, accum, level, eps=ADAMW["eps"]):
    """Losses, gradient norms and whole parameters after training on a dp x tp mesh (4 ranks)."""
    batches = _batches()
    mesh = loom.init({"dp": dp, "tp": tp})
    model = GPT(CONFIG, Strategies(dp, tp, sequence_parallel))
    for block in model.blocks:
        recompute(block, policy)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows(batches[0][0]), rows(batches[0][1])))
    losses, norms = _train(model, batches, accum, rows, level, eps)
    with model.loom.full_parameters():  # at optimizer level 3 parameters are sharded at rest
        params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, norms, params


# (dp, tp, sequence parallel, recompute, accumulation, optimizer level). `make test` runs a sample that
# covers every value of every field; `make test-all` runs them all.
SAMPLE = [
    (2, 2, True, "none", 2, 0),
    (1, 4, True, "full", 1, 0),
    (4, 1, False, "selective", 2, 0),
    (4, 1, False, "none", 1, 1),
    (2, 2, True, "selective", 2, 1),
    (2, 2, False, "none", 2, 2),
    (1, 4, True, "none", 1, 2),
    (2, 2, True, "selective", 1, 3),
    (4, 1, False, "full", 2, 3),
]
MORE = [
    (4, 1, False, "none", 1, 0),
    (1, 4, False, "none", 1, 0),
    (2, 2, False, "none", 1, 0),
    (2, 2, True, "selective", 1, 0),
    (2, 2, False, "full", 2, 0),
    (4, 1, False, "full", 2, 2),
    (2, 2, False, "none", 1, 1),
    (2, 2, True, "full", 1, 2),
    (1, 4, False, "selective", 2, 1),
    (4, 1, False, "none", 1, 3),
    (2, 2, False, "none", 2, 3),
    (1, 4, False, "full", 1, 3),
]
CASES = SAMPLE + [pytest.param(*case, marks=pytest.mark.slow) for case in MORE]


@pytest.mark.parametrize(("dp", "tp", "sp", "policy", "accum", "level"), CASES)
def test_gpt_training_matches_one_device(dist_run, dp, tp, sp, policy, accum, level):
    expected, expected_norms, reference = _reference(accum, ADAMW["eps"])
    for losses, norms, params in dist_run(4, train_case, dp, tp, sp, policy, accum, level):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0)
        assert_params_close(params, reference, lr=ADAMW["lr"], steps=STEPS)


def test_true_adamw_moves_parameters_within_its_lr_bound(dist_run):
    """The one case with AdamW's default eps = 1e-8 (tests/equivalence.py, rule 3): an entry whose gradients
    are near zero may move by up to lr on a rounding difference, so parameters are held to the lr bound."""
    expected, expected_norms, reference = _reference(2, 1e-8)
    for losses, norms, params in dist_run(4, train_case, 2, 2, True, "none", 2, 2, 1e-8):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0)
        assert_adamw_params_close(params, reference, lr=ADAMW["lr"], steps=STEPS)
