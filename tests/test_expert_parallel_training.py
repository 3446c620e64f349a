"""Tier 2: loom's GPT with mixtures of experts, trained through the Trainer with expert parallelism on 4
ranks, against one device.

A tiny MoE GPT (2 layers, d_model 32, 4 SwiGLU experts, top-2, dropless, balancing loss, z-loss and the
balancing bias) trains 5 steps of Lipschitz AdamW (tests/equivalence.py) on one device and, in one worker
body, on each mesh of `CASES`: ep 2 of dp 4 at optimizer level 1 (the experts' states sharded over their
expert-dp group of 2), the same at level 3 (the expert weights also sharded at rest over their expert-dp
group, gathered around their block's forward and backward), ep 2 of dp 2 with tp 2 and sequence
parallelism for the dense layers and full recomputation, and ep 4 of dp 4 (no expert-dp replica) at
optimizer level 2 with selective recomputation. Compared: losses
and gradient norms (rtol 1e-5), every whole parameter (`assert_params_close`) and the balancing biases
(exactly: the loads are integers); each rank's expert shards are the same within an expert-dp group and
differ across the ep group. The balancing losses are the whole batch's on every mesh, so one reference
serves every case. The first case's checkpoint, loaded at the last case's mesh (ep 2 -> ep 4, optimizer
level 1 -> 2), gives back the same whole parameters and biases, bitwise. One more forward and backward
at the first mesh issues the all-to-alls `loom.cost.moe.moe_collectives` predicts.
"""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, assert_params_close
from job_cases import job_config

import loom
from loom.checkpoint import load_checkpoint, save_checkpoint
from loom.cost.moe import moe_collectives
from loom.dist.comm import CollectiveRecorder
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.models.moe import moe_layers
from loom.parallel import make_optimizer
from loom.recompute import recompute
from loom.train import Trainer
from loom.train.config import load_config
from loom.train.job import run

STEPS, GLOBAL_BATCH, SEQ = 5, 8, 8
CONFIG = GPTConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ, mlp="swiglu", experts=4, top_k=2,
    z_loss_coef=1e-3, expert_bias_rate=1e-2,
)  # fmt: skip
# (dp, tp, ep, sequence parallel, optimizer level, recompute)
CASES = [
    (4, 1, 2, False, 1, "none"),
    (4, 1, 2, False, 3, "none"),
    (2, 2, 2, True, 0, "full"),
    (4, 1, 4, False, 2, "selective"),
]


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


def _trainer(model, level=0):
    optimizer = make_optimizer(model, torch.optim.AdamW, level, **ADAMW)
    return Trainer(model, optimizer, clip_grad_norm=0.5)


def _train(trainer, rows):
    results = [trainer.train_step([(rows(ids), rows(targets))]) for ids, targets in _batches()]
    return [r.loss for r in results], [r.grad_norm for r in results]


def _biases(model):
    return torch.stack([moe.expert_bias for moe in moe_layers(model)])


@functools.cache
def _reference():
    model = GPT(CONFIG)
    losses, norms = _train(_trainer(model), lambda t: t)
    params = {name: p.detach() for name, p in model.named_parameters()}
    return losses, norms, params, _biases(model)


def _shards_differ_as_expected(model, mesh, ep: int) -> list[str]:
    """Within an expert-dp group every rank holds the same expert shard; across the ep group they differ."""
    errors = []
    weight = model.blocks[0].mlp.moe.experts.down_proj
    local = weight.to_local().contiguous()
    if local.shape[0] != CONFIG.experts // ep:
        errors.append(f"local experts {local.shape[0]} != {CONFIG.experts // ep}")
    peers = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(peers, local)
    dp_rank = lambda rank: rank // mesh.axis_size("tp")  # noqa: E731  (tp innermost)
    for rank, peer in enumerate(peers):
        same_experts = dp_rank(rank) % ep == mesh.dp_rank() % ep
        if same_experts != torch.equal(peer, local):
            errors.append(
                f"rank {rank}: shard {'differs' if same_experts else 'equal'} (same experts: {same_experts})"
            )
    return errors


def _exchanges_as_predicted(model, rows, ep: int) -> list[str]:
    """One more forward and backward: the all-to-alls this rank issues are those `moe_collectives`
    predicts for the rows each layer moved (4 bytes an element, 8 a count)."""
    ids, targets = _batches()[0]
    with CollectiveRecorder() as recorder:
        model(rows(ids), rows(targets)).backward()
    got = Counter({key: n for key, n in recorder.summary().items() if key[0] == "all_to_all"})
    want = Counter()
    for moe in moe_layers(model):
        moved = moe.experts.exchange
        for c in moe_collectives(
            experts=CONFIG.experts, hidden=CONFIG.d_model, sent_rows=moved.sent_rows,
            received_rows=moved.received_rows, element_bytes=4, ep=ep,
        ):  # fmt: skip
            want[("all_to_all", ep, c.nbytes)] += c.count
    return [] if got == want else [f"all-to-alls {dict(got)} != predicted {dict(want)}"]


def _parallel_gpt(dp, tp, ep, sequence_parallel):
    """The MoE GPT laid out on a dp x tp mesh with its experts over ep, and a function giving this rank's
    rows of a global batch."""
    mesh = loom.init({"dp": dp, "tp": tp} if tp > 1 else {"dp": dp})
    model = GPT(CONFIG, Strategies(dp, tp, sequence_parallel, ep))
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    ids, targets = _batches()[0]
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows(ids), rows(targets)))
    assert (model.blocks[0].mlp.moe.experts.exchange is not None) == (ep > 1)  # connected by parallelize
    return model, mesh, rows


def _whole(model):
    with model.loom.full_parameters():
        return {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}


def ep_cases(root: str) -> tuple[list[tuple], list[str]]:
    """Every case of `CASES` on this worker: (case, losses, norms, whole parameters, biases, errors); then
    the first case's checkpoint (saved under `root`) loaded at the last case's mesh: what differs."""
    results = []
    for index, (dp, tp, ep, sequence_parallel, level, policy) in enumerate(CASES):
        model, mesh, rows = _parallel_gpt(dp, tp, ep, sequence_parallel)
        for block in model.blocks:  # recomputed blocks exchange their tokens again in backward
            recompute(block, policy)
        trainer = _trainer(model, level)
        losses, norms = _train(trainer, rows)
        with model.loom.full_parameters():  # level 3: sharded at rest
            errors = _shards_differ_as_expected(model, mesh, ep)
        if level == 3 and model.blocks[0].mlp.moe.experts.up_proj.to_local().untyped_storage().nbytes():
            errors.append("level 3: the expert shard holds memory at rest")
        if level:  # the experts' optimizer states and gradients are cut over their expert-dp group alone
            bucket = model.loom.grad_sync.bucket_of.get(model.blocks[0].mlp.moe.experts.up_proj)
            size = bucket.group_size if bucket is not None else 1
            if size != dp // ep:
                errors.append(f"expert states sharded over {size} ranks, not dp / ep = {dp // ep}")
        case = (dp, tp, ep, sequence_parallel, level, policy)
        results.append((case, losses, norms, _whole(model), _biases(model), errors))
        if index == 0:
            save_checkpoint(root, trainer)
            errors += _exchanges_as_predicted(model, rows, ep)
    model, _, _ = _parallel_gpt(*CASES[-1][:4])
    trainer = _trainer(model, CASES[-1][4])
    load_checkpoint(root, trainer)
    saved, loaded = results[0][3], _whole(model)
    differ = [name for name in saved if not torch.equal(saved[name], loaded[name])]
    if not torch.equal(_biases(model), results[0][4]):
        differ.append("expert biases")
    return results, differ


def test_expert_parallel_gpt_training_matches_one_device_and_its_checkpoint_reshards(dist_run, tmp_path):
    expected, expected_norms, reference, biases = _reference()
    for rank, (cases, differ) in enumerate(dist_run(4, ep_cases, str(tmp_path))):
        assert not differ, f"rank {rank}: loaded at another ep, these differ from what was saved: {differ}"
        for case, losses, norms, params, bias, errors in cases:
            where = f"rank {rank}, (dp, tp, ep, sp, level, recompute) = {case}"
            assert not errors, f"{where}: {errors}"
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0, msg=where
            )
            torch.testing.assert_close(
                torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0, msg=where
            )
            assert_params_close(params, reference, lr=ADAMW["lr"], steps=STEPS)
            assert torch.equal(bias, biases), where


def _config(*overrides: str):
    return load_config(None, ["--model.d_model", "32", "--train.global_batch", "12", *overrides])


RULES = [
    (["--parallel.ep", "2"], 4, "parallel.ep = 2 shards experts, but the model has none"),
    (["--model.experts", "4", "--parallel.ep", "3"], 6, "parallel.ep = 3 must divide model.experts = 4"),
    (["--model.experts", "4", "--parallel.ep", "4"], 2, "parallel.ep = 4 .* divide dp = 2"),
    (
        ["--model.experts", "4", "--parallel.ep", "2"],
        6,
        r"innermost factors of dp = 6 \(prime factors \[2, 3\]\)",
    ),
    (  # with a pipeline, each stage's experts are cut over its own dp ranks: world / pp
        ["--model.experts", "4", "--parallel.pp", "2", "--parallel.ep", "4", "--parallel.microbatches", "2"],
        4,
        "parallel.ep = 4 .* divide dp = 2",
    ),
    (["--model.experts", "4", "--model.top_k", "5"], 1, "model.top_k = 5 is out of range"),
]


@pytest.mark.parametrize(("overrides", "world", "message"), RULES)
def test_expert_parallel_settings_that_cannot_run_are_refused_with_the_fix(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        _config(*overrides).validate(world)


def test_a_config_with_experts_describes_the_model_once():
    config = _config("--model.experts", "4", "--model.top_k", "1", "--parallel.ep", "2")
    config.validate(4)
    assert config.model.gpt_config().experts == 4
    cost = config.model.transformer_config()
    assert (cost.experts, cost.top_k) == (4, 1)
    assert config.plan(4).ep == 2


def test_loom_train_with_parallel_ep_follows_one_device(dist_run, tmp_path):
    """The job `loom train` runs: `[model] experts` and `[parallel] ep = 2` of dp 4 at optimizer level 1
    give the one-device losses."""
    moe = {"experts": 4, "mlp": "swiglu", "z_loss_coef": 1e-3, "expert_bias_rate": 1e-2}
    one = job_config(tmp_path, model=moe, parallel={"dp": 1}, train={"workers": 1, "steps": 4})
    parallel = {"dp": 4, "ep": 2, "optimizer_level": 1}
    four = job_config(tmp_path, model=moe, parallel=parallel, train={"workers": 4, "steps": 4})
    expected = dist_run(1, run, one)[0]["losses"]
    assert len(expected) == 4
    assert dist_run(4, run, four)[0]["losses"] == pytest.approx(expected, rel=RTOL)
