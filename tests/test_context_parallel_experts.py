"""Tier 2: loom's mixture-of-experts GPT with its sequences cut over cp, trained through the Trainer on 4
ranks, against one device.

The MoE GPT of tests/test_expert_parallel_training.py (2 layers, d_model 32, 4 SwiGLU experts, top-2,
dropless, balancing loss, z-loss and the balancing bias) trains 5 steps of Lipschitz AdamW on one device and
on cp = 2 x dp = 2 (ring attention; Ulysses with its experts cut over ep = 2). Each rank routes its own tokens;
the balancing losses' sums (tokens, pairs and probabilities per expert, z) are summed over the dp x cp ranks
before the losses are formed, so that they are the whole batch's. Compared: losses and gradient norms (rtol
`RTOL`), every whole parameter (`assert_params_close`) and the balancing biases (exactly: the loads are
integers). `loom train` with experts and cp = 2 against dp = 4 (tier 3).
"""

import functools

import pytest
import torch
from equivalence import ADAMW, RTOL, assert_params_close
from job_cases import job_config
from test_expert_parallel_training import _biases

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.train import Trainer
from loom.train.job import run

STEPS, GLOBAL_BATCH, SEQ = 5, 8, 8
CONFIG = GPTConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, mlp="swiglu", experts=4, top_k=2,
    z_loss_coef=1e-3, expert_bias_rate=1e-2, positions="rotary",
)  # fmt: skip
# (dp, ep, attention)
CASES = [(2, 1, "ring"), (2, 2, "ulysses")]


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _train(model, inputs):
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 0, **ADAMW), clip_grad_norm=0.5)
    results = [trainer.train_step([inputs(ids, targets)]) for ids, targets in _batches()]
    return [r.loss for r in results], [r.grad_norm for r in results]


@functools.cache
def _reference():
    model = GPT(CONFIG)
    losses, norms = _train(model, lambda ids, targets: (ids, targets))
    return losses, norms, {name: p.detach() for name, p in model.named_parameters()}, _biases(model)


def train_case(dp, ep, attention):
    mesh = loom.init({"dp": dp, "cp": 2})
    model = GPT(CONFIG, Strategies(dp, 1, False, ep, cp=2, attention=attention), mesh=mesh)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731

    def inputs(ids, targets):
        return model.shard_inputs(rows(ids), rows(targets))

    loom.parallelize(model, mode="semi_auto", example_inputs=inputs(*_batches()[0]))
    losses, norms = _train(model, inputs)
    params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, norms, params, _biases(model)


def cases_body(cases):
    return [train_case(*case) for case in cases]


def _check(cases, dist_run):
    ref_losses, ref_norms, ref_params, ref_biases = _reference()
    for per_rank in dist_run(4, cases_body, cases):
        for case, (losses, norms, params, biases) in zip(cases, per_rank, strict=True):
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0, msg=str(case)
            )
            torch.testing.assert_close(
                torch.tensor(norms), torch.tensor(ref_norms), rtol=RTOL, atol=0, msg=str(case)
            )
            assert_params_close(params, ref_params, lr=ADAMW["lr"], steps=STEPS)
            assert torch.equal(biases, ref_biases), case


def test_moe_gpt_with_its_sequences_cut_over_cp_matches_one_device(dist_run):
    """cp = 2 x dp = 2, ring attention, the experts whole on every rank."""
    _check(CASES[:1], dist_run)


@pytest.mark.slow
def test_moe_gpt_under_cp_with_experts_cut_over_ep_matches_one_device(dist_run):
    """cp = 2 x dp = 2, Ulysses, the experts cut over ep = 2 of the dp ranks (each cp rank exchanges its own
    tokens with its ep peers of the same cp index)."""
    _check(CASES[1:], dist_run)


def job_case(cp_config, dp_config):
    return run(cp_config), run(dp_config)


@pytest.mark.slow
def test_loom_train_with_experts_and_cp_gives_the_losses_of_dp(dist_run, tmp_path):
    """`[parallel] cp = 2` (ring attention) x dp = 2 against dp = 4, a mixture of experts in every block: the
    same losses (the balancing loss included), and the report decoded by a whole copy of the model."""
    model, train = {"experts": 4, "top_k": 2}, {"steps": 3, "workers": 4}
    cp = job_config(tmp_path, model=model, parallel={"dp": 2, "cp": 2, "attention": "ring"}, train=train)
    dp = job_config(tmp_path, model=model, parallel={"dp": 4}, train=train)
    for cp_summary, dp_summary in dist_run(4, job_case, cp, dp):
        torch.testing.assert_close(
            torch.tensor(cp_summary["losses"]), torch.tensor(dp_summary["losses"]), rtol=RTOL, atol=0
        )
        assert len(cp_summary["text_samples"]) == 3
