"""Tier 2: the reference GPT trained with its sequences cut over cp equals one device.

3 SGD steps of a rotary GPT (2 layers, hidden 32, 4 heads, sequence 16) on 4 ranks, cp = 2 x dp = 2 and
cp = 2 x tp = 2, with Ulysses and with ring attention: the same losses (rtol `RTOL`) and the same parameters
(`assert_params_close` with SGD, tests/equivalence.py); with tp = 2 the second step's collectives, recorded,
equal `Plan.predicted_collectives` (kind, axes, bytes, count). Learned positions once (cp = 2 x dp = 2,
ring). The model's refusals (sequence, heads, mesh) and `[parallel] cp`'s in a training config; `loom train` with
cp = 2 against tp = 2 (tier 3).
"""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from equivalence import RTOL, assert_params_close
from job_cases import job_config
from torch.distributed.tensor import DTensor

import loom
from loom.cost.traffic import summary
from loom.cost.transformer import transformer_config
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.plan import Plan
from loom.train.job import run

STEPS, GLOBAL_BATCH, SEQ, LR = 3, 4, 16, 0.1
ROTARY = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, positions="rotary")
LEARNED = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, positions="learned")
# (dp, tp, attention, config): every 4-rank case runs in one dist_run body
CASES = [(2, 1, "ulysses", ROTARY), (1, 2, "ulysses", ROTARY), (2, 1, "ring", ROTARY), (1, 2, "ring", ROTARY)]
CASES += [(2, 1, "ring", LEARNED)]


def _batches():
    """Targets shifted on the whole sequence, before any cut."""
    ids = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _train(model, batches, watch=None):
    """SGD steps; `watch` (a context manager) around the second step, the first having checked the ranks'
    agreement and learnt the gradient buckets."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, (ids, targets) in enumerate(batches):
        with watch if watch is not None and step == 1 else contextlib.nullcontext():
            loss = _step(model, optimizer, ids, targets)
        losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())  # not watched
    return losses


def _step(model, optimizer, ids, targets):
    optimizer.zero_grad()
    loss = model(ids, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


@functools.cache
def _reference(config):
    model = GPT(config)
    losses = _train(model, _batches())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def train_case(dp, tp, attention, config):
    """Losses, whole parameters and the second step's collectives after training on a dp x cp x tp mesh
    (cp = 2)."""
    mesh = loom.init({"dp": dp, "cp": 2, "tp": tp})
    model = GPT(config, Strategies(dp, tp, cp=2, attention=attention), mesh=mesh)
    batches = [
        model.shard_inputs(ids.chunk(dp)[mesh.dp_rank()], targets.chunk(dp)[mesh.dp_rank()])
        for ids, targets in _batches()
    ]
    loom.parallelize(model, mode="semi_auto", example_inputs=batches[0])
    recorder = CollectiveRecorder()
    losses = _train(model, batches, recorder)
    params = {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}
    return losses, params, recorder.summary(mesh_axes(("dp", "cp", "tp"), (dp, 2, tp), dist.get_rank()))


def _predicted(dp, tp, attention):
    plan = Plan(dp=dp, cp=2, tp=tp, attention=attention)
    predicted = plan.predicted_collectives(
        transformer_config(ROTARY), global_batch=GLOBAL_BATCH, seq=SEQ, counted_loss=False
    )
    return summary(predicted)


def _refusal(make) -> str:
    try:
        make()
    except ValueError as error:
        return str(error)
    return "no error"


def cp_cases():
    """Every case, on the same 4 ranks; then the refusals that need a cp group."""
    results = [train_case(*case) for case in CASES]
    mesh = loom.init({"dp": 1, "cp": 2, "tp": 2})
    ids = torch.zeros(2, SEQ - 2, dtype=torch.int64)
    ring = GPT(ROTARY, Strategies(1, 2, cp=2, attention="ring"), mesh=mesh)
    ulysses = GPT(ROTARY, Strategies(1, 2, cp=2, attention="ulysses"), mesh=mesh)
    refusals = [
        _refusal(lambda: ring.shard_inputs(ids)),  # 14 tokens: not 4 head-tail chunks
        _refusal(lambda: ulysses.shard_inputs(ids[:, :13])),  # 13 tokens: not 2 halves
        _refusal(lambda: ring(ids[:, :10])),  # 10 per rank: 20 > max_seq_len
        _refusal(lambda: GPT(ROTARY, Strategies(1, 2, cp=2, attention="ulysses"), mesh=loom.init({"cp": 4}))),
    ]
    return results, refusals


def test_context_parallel_training_matches_one_device(dist_run):
    for per_rank, refusals in dist_run(4, cp_cases):
        assert "14 tokens does not cut evenly over cp 2 with ring attention" in refusals[0], refusals[0]
        assert "multiple of 4" in refusals[0]
        assert "multiple of 2" in refusals[1], refusals[1]
        assert "20 tokens (10 per rank x cp 2) is longer than max_seq_len 16" in refusals[2], refusals[2]
        assert "needs the mesh whose 'cp' axis has 2 ranks" in refusals[3], refusals[3]
        for (dp, tp, attention, config), (losses, params, recorded) in zip(CASES, per_rank, strict=True):
            expected, reference = _reference(config)
            case = f"dp {dp} tp {tp} {attention} {config.positions}"
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0, msg=case
            )
            assert_params_close(params, reference, lr=LR, steps=STEPS, eps=1.0)
            if tp > 1:  # the prediction covers tensor-parallel layouts
                expected = _predicted(dp, tp, attention)
                assert recorded == expected, (case, recorded - expected, expected - recorded)


def test_ulysses_needs_tp_times_cp_to_divide_the_heads():
    with pytest.raises(ValueError, match=r"tp x cp = 8 must divide n_heads 4.*attention='ring'"):
        GPT(ROTARY, Strategies(1, 2, cp=4, attention="ulysses"))
    with pytest.raises(ValueError, match="needs the mesh whose 'cp' axis has 4 ranks"):
        GPT(ROTARY, Strategies(1, 2, cp=4, attention="ring"))
    with pytest.raises(ValueError, match="attention 'flash' is not one of"):
        Strategies(cp=2, attention="flash")


def job_case(cp_config, tp_config):
    return run(cp_config), run(tp_config)


def test_loom_train_with_cp_gives_the_losses_of_tp(dist_run, tmp_path):
    """`[parallel] cp = 2` (ring attention) x dp = 2 against dp = 2 x tp = 2: the same losses, and the report
    decoded by a whole copy of the model on every rank."""
    steps = {"steps": 3, "workers": 4}
    cp = job_config(tmp_path, parallel={"dp": 2, "cp": 2, "attention": "ring"}, train=steps)
    tp = job_config(tmp_path, parallel={"dp": 2, "tp": 2}, train=steps)
    for cp_summary, tp_summary in dist_run(4, job_case, cp, tp):
        torch.testing.assert_close(
            torch.tensor(cp_summary["losses"]), torch.tensor(tp_summary["losses"]), rtol=RTOL, atol=0
        )
        assert len(cp_summary["text_samples"]) == 3


@pytest.mark.parametrize(
    ("parallel", "data", "error"),
    [
        (
            {"cp": 4, "attention": "ring"},
            {"seq_len": 12},
            "into 8 equal chunks; use a seq_len divisible by 8",
        ),
        ({"cp": 4}, {}, "tp \\* cp = 4 must divide model.n_heads = 2; use attention = 'ring'"),
        ({"cp": 2, "attention": "flash"}, {}, "attention"),
    ],
)
def test_train_config_refuses_what_cp_cannot_run(tmp_path, parallel, data, error):
    with pytest.raises(ValueError, match=error):
        job_config(tmp_path, parallel={"dp": 1, **parallel}, data=data).validate()


def test_sequence_parallelism_under_cp_cuts_each_ranks_piece_over_tp(tmp_path):
    parallel = {"dp": 1, "cp": 2, "tp": 4, "sequence_parallel": True, "attention": "ring"}
    with pytest.raises(ValueError, match="tp = 4 x parallel.cp = 2; use a seq_len divisible by 8"):
        # each rank's 6 tokens of a sequence do not cut over tp = 4
        job_config(tmp_path, model={"n_heads": 4}, data={"seq_len": 12}, parallel=parallel).validate()
