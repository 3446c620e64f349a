"""Tier 2: a Hugging Face Mixtral, unedited, with its experts under expert parallelism through a Plan, on 4
ranks against one device.

A tiny Mixtral (2 layers, hidden 64, 4 experts, top-2: tests/hf_models.py) trains 3 Trainer steps of
Lipschitz AdamW (tests/equivalence.py) with its gradient norm clipped, on one device and, in one worker body,
at `Plan(dp=4, ep=2)` (nothing else planned) and at `Plan(dp=2, tp=2, ep=2)` with Megatron's layouts for
attention. Compared: losses and gradient norms (rtol 1e-5: the norm counts each expert shard once per
expert-dp replica) and every whole parameter (`assert_params_close`). Each rank holds 2 of the 4 experts of
every layer, the same as its expert-dp peers and not as its ep peer. One more forward and backward at the
first mesh issues the all-to-alls `loom.cost.moe.moe_collectives` predicts. Plans loom cannot run are
refused first, naming the fix.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW, RTOL, assert_params_close
from hf_job_cases import hf_job
from hf_models import batches, build

import loom
from loom.cost.moe import moe_collectives
from loom.dist.comm import CollectiveRecorder
from loom.models import hf
from loom.models.recipes import tensor_plan
from loom.parallel import make_optimizer
from loom.plan import Plan
from loom.train import Trainer
from loom.train.job import run

STEPS, EP, EXPERTS, HIDDEN = 3, 2, 4, 64
MESHES = [(4, 1), (2, 2)]  # (dp, tp), each with ep 2


def _pairs():
    """(inputs, targets) of every step: 4 rows of 16 tokens, the targets shifted by one."""
    return [(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()) for ids in batches(STEPS, rows=4, seq=17)]


def _train(model, rows):
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 0, **ADAMW), clip_grad_norm=0.5)
    results = [trainer.train_step([(rows(x), rows(y))]) for x, y in _pairs()]
    return [r.loss for r in results], [r.grad_norm for r in results]


def _whole(model):
    return {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}


def _refused(model, plan) -> str:
    try:
        loom.parallelize(model, plan=plan)
    except ValueError as error:
        return str(error)
    return "not refused"


def _shards_differ_as_expected(model, mesh) -> list[str]:
    """Within an expert-dp group every rank holds the same experts; across the ep group they differ."""
    local = model.model.layers[0].mlp.experts.down_proj.to_local().contiguous()
    errors = [] if local.shape[0] == EXPERTS // EP else [f"local experts {local.shape[0]}"]
    peers = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(peers, local)
    tp = mesh.axis_size("tp")
    for rank, peer in enumerate(peers):
        same = (rank // tp) % EP == mesh.dp_rank() % EP
        if same != torch.equal(peer, local):
            errors.append(f"rank {rank}: shard {'differs' if same else 'equal'} (same experts: {same})")
    return errors


def _exchanges_as_predicted(model, rows) -> list[str]:
    """One more forward and backward: this rank's all-to-alls are those `moe_collectives` predicts for
    the rows each layer moved (4 bytes an element, 8 a count)."""
    inputs, targets = _pairs()[0]
    with CollectiveRecorder() as recorder:
        model(rows(inputs), rows(targets)).backward()
    got = Counter({key: n for key, n in recorder.summary().items() if key[0] == "all_to_all"})
    want = Counter()
    for layer in model.model.layers:
        moved = layer.mlp.experts.loom_exchange
        for c in moe_collectives(
            experts=EXPERTS, hidden=HIDDEN, sent_rows=moved.sent_rows, received_rows=moved.received_rows,
            element_bytes=4, ep=EP,
        ):  # fmt: skip
            want[("all_to_all", EP, c.nbytes)] += c.count
    return [] if got == want else [f"all-to-alls {dict(got)} != predicted {dict(want)}"]


def mixtral_ep_cases() -> tuple[list[str], list[tuple]]:
    """On this worker: the refusals, then (mesh, losses, norms, whole parameters, errors) per mesh."""
    loom.init({"dp": 4})
    refusals = [
        _refused(build("llama", layers=1), Plan(dp=4, ep=EP)),
        _refused(build("mixtral", layers=1, experts=6), Plan(dp=4, ep=4)),
    ]
    results = []
    for index, (dp, tp) in enumerate(MESHES):
        mesh = loom.init({"dp": dp, "tp": tp} if tp > 1 else {"dp": dp})
        model = build("mixtral")
        planned = tensor_plan(model) if tp > 1 else {}
        loom.parallelize(model, plan=Plan(dp=dp, tp=tp, ep=EP, strategies=planned))
        hf.train_on_token_pairs(model)
        rows = lambda t, dp=dp, mesh=mesh: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
        losses, norms = _train(model, rows)
        errors = _shards_differ_as_expected(model, mesh)
        if index == 0:
            errors += _exchanges_as_predicted(model, rows)
        results.append(((dp, tp), losses, norms, _whole(model), errors))
    return refusals, results


def test_hugging_face_mixtral_with_expert_parallel_experts_matches_one_device(dist_run):
    reference = hf.train_on_token_pairs(build("mixtral"))
    expected, expected_norms = _train(reference, lambda t: t)
    params = _whole(reference)
    for rank, (refusals, results) in enumerate(dist_run(4, mixtral_ep_cases)):
        assert "LlamaForCausalLM has no experts module loom recognises" in refusals[0], refusals[0]
        assert "set ep = 1, or give its family a Recipe with experts=" in refusals[0], refusals[0]
        assert (
            "ep = 4 must divide the experts of model.layers.0.mlp.experts = 6; choose ep in [1, 2]"
            in (refusals[1])
        ), refusals[1]
        for mesh, losses, norms, whole, errors in results:
            where = f"rank {rank}, (dp, tp) = {mesh}, ep {EP}"
            assert not errors, f"{where}: {errors}"
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0, msg=where
            )
            torch.testing.assert_close(
                torch.tensor(norms), torch.tensor(expected_norms), rtol=RTOL, atol=0, msg=where
            )
            assert_params_close(whole, params, lr=ADAMW["lr"], steps=STEPS)


@pytest.mark.slow  # make test keeps loom train with ep on loom's GPT (test_expert_parallel_training.py)
@pytest.mark.parametrize("level", [1, 3])
def test_loom_train_with_parallel_ep_on_a_hugging_face_mixtral_follows_one_device(dist_run, tmp_path, level):
    """`loom train` on a Mixtral config.json with `[parallel] dp = 4, ep = 2` at optimizer level 1 or 3
    gives the one-device losses; its checkpoint, its experts cut over ep, resumes on one device (every
    expert whole, optimizer level 0) with the one-device loss of the next step."""
    checkpoint = {"dir": str(tmp_path / "ckpt"), "every_steps": 3}
    train = {"workers": 1, "steps": 4, "schedule": "constant"}  # the 3-step run's rates are the 4-step run's
    one = hf_job(tmp_path, "mixtral", parallel={"dp": 1}, train=train)
    four = hf_job(
        tmp_path, "mixtral", parallel={"dp": 4, "ep": 2, "optimizer_level": level},
        train=train | {"workers": 4, "steps": 3}, checkpoint=checkpoint,
    )  # fmt: skip
    again = hf_job(tmp_path, "mixtral", parallel={"dp": 1}, train=train, checkpoint=checkpoint)
    expected = dist_run(1, run, one)[0]["losses"]
    assert len(expected) == 4
    assert dist_run(4, run, four)[0]["losses"] == pytest.approx(expected[:3], rel=RTOL)
    resumed = dist_run(1, run, again)[0]
    assert resumed["first_step"] == 4
    assert resumed["losses"] == pytest.approx(expected[3:], rel=RTOL)


@pytest.mark.parametrize(
    ("family", "parallel", "message"),
    [
        (
            "llama",
            {"dp": 2, "ep": 2},
            r"loom knows no experts module in LlamaForCausalLM .*set parallel.ep = 1",
        ),
        ("mixtral", {"dp": 6, "ep": 3}, r"parallel.ep = 3 must divide num_local_experts in .* = 4"),
        (  # with a pipeline, each stage's experts are cut over its own dp ranks
            "mixtral",
            {"dp": 2, "ep": 4, "pp": 2, "microbatches": 2},
            r"parallel.ep = 4 .*divide dp = 2",
        ),
    ],
)
def test_loom_train_refuses_an_ep_a_hugging_face_model_cannot_take(tmp_path, family, parallel, message):
    with pytest.raises(ValueError, match=message):
        hf_job(tmp_path, family, parallel=parallel)
