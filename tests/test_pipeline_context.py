"""Tier 2: loom's GPT cut into pipeline stages whose sequences are cut over cp, against one device.

Each stage is laid out on its pipeline rank's dp x cp x tp ranks; every rank brings its piece of its
replica's sequences (`GPT.shard_inputs`), and cp rank r of stage s sends its piece of the residual stream to
cp rank r of stage s+1. 3 SGD steps of a tiny GPT (one block per stage, tied embeddings) through the pipeline give one
device's losses (`RTOL`), first-step gradients (`RTOL`, `GRAD_ATOL`) and parameters (`param_atol` with
SGD): pp 2 x cp 2 on 4 ranks with Ulysses attention, learned positions and 1f1b (in `make test`); marked
slow: ring attention with rotary positions under 1f1b, interleaved and zero-bubble schedules, pp 2 x cp 2 x
dp 2 (also with experts cut over ep 2) and pp 2 x cp 2 x tp 2 on 8 ranks. Each rank's cp exchanges of the
second step (all-to-alls, sends and receives on the cp group) are `loom.cost.context`'s formula times its
layers and micro-batches. Also: `loom train` with `[parallel] pp = 2, cp = 2`, the config and Plan accepting
cp with pp, and `model_pipeline` (any other model) refusing a cp axis."""

import contextlib
import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from equivalence import GRAD_ATOL, RTOL, param_atol
from job_cases import job_config
from test_pipeline_hf import build

import loom
from loom.cost.context import ring_collectives, ulysses_collectives
from loom.cost.traffic import summary
from loom.dist.comm import CollectiveRecorder, mesh_axes
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.parallel.pipeline import gpt_pipeline, model_pipeline, source_names
from loom.train.config import load_config
from loom.train.job import run

STEPS, BATCH, SEQ, LR = 3, 4, 8, 0.5
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
ATTENTION_KINDS = ("all_to_all", "send", "recv")  # Ulysses' and ring attention's (gradients: all-reduces)
VIRTUAL = {"interleaved": 2, "zero_bubble": 2, "zbv": 2}  # stages per rank (4 layers: one block each)


def _config(positions: str, schedule: str) -> GPTConfig:
    """`positions` "learned" or "rotary"; "+moe": 4 experts (top-2, dropless) without balancing losses, so
    that routing is per token and the micro-batches' grouping changes nothing."""
    positions, _, moe = positions.partition("+")
    experts = {"experts": 4, "top_k": 2, "aux_loss_coef": 0.0} if moe else {}
    layers = 2 * VIRTUAL.get(schedule, 1)  # one block per stage
    return dataclasses.replace(CONFIG, n_layers=layers, positions=positions, **experts)


def _batches():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, SEQ + 1), generator=generator)
    return [(step[:, :-1], step[:, 1:]) for step in ids]


@functools.cache
def _reference(positions: str, schedule: str):
    """One device, 3 SGD steps on the whole batches: losses, first-step gradients, final parameters."""
    model = GPT(_config(positions, schedule))
    sgd, losses, grads = torch.optim.SGD(model.parameters(), lr=LR), [], {}
    for ids, targets in _batches():
        loss = model(ids, targets)
        loss.backward()
        if not grads:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        sgd.step()
        sgd.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def cp_pipeline_case(schedule: str, attention: str, positions: str, dp: int, tp: int, microbatches: int):
    """3 SGD steps of the GPT's pipeline on pp 2 x dp x cp 2 x tp, each rank bringing its piece of its
    replica's sequences; the losses, the whole first-step gradients and final parameters of its stages."""
    mesh = loom.init({"pp": 2} | ({"dp": dp} if dp > 1 else {}) | {"cp": 2} | ({"tp": tp} if tp > 1 else {}))
    with torch.device("meta"):  # as `loom train` builds it: each rank materialises its stages only
        ep = dp if "moe" in positions else 1  # experts cut over the stage's dp ranks
        model = GPT(
            _config(positions, schedule), Strategies(dp, tp, ep=ep, cp=2, attention=attention), mesh=mesh
        )
    virtual = VIRTUAL.get(schedule, 1)
    pipe = gpt_pipeline(model, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual)
    sgd = make_optimizer(pipe, torch.optim.SGD, 0, lr=LR)
    rows = lambda t: t.chunk(dp)[mesh.dp_rank()]  # noqa: E731
    losses, grads, recorder = [], {}, CollectiveRecorder()
    for step, (ids, targets) in enumerate(_batches()):
        with (
            recorder if step == 1 else contextlib.nullcontext()
        ):  # the first step checks the ranks' agreement
            losses.append(pipe.step(*model.shard_inputs(rows(ids), rows(targets))))
        if not grads:
            grads = _whole(model, pipe, lambda p: p.grad)
        sgd.step()
        sgd.zero_grad()
    names = tuple(name for name, _ in mesh.axis_sizes())
    sizes = tuple(size for _, size in mesh.axis_sizes())
    recorded = recorder.summary(mesh_axes(names, sizes, dist.get_rank()))
    attention = Counter(
        {key: n for key, n in recorded.items() if key[1] == "cp" and key[0] in ATTENTION_KINDS}
    )
    blocks = sum(len(stage.blocks) for stage in pipe.modules)
    return losses, grads, _whole(model, pipe, lambda p: p.detach()), attention, blocks


def _whole(model, pipe, get) -> dict[str, torch.Tensor]:
    """`get(param)` of every parameter of this rank's stages, whole, under the model's names."""
    return {
        name: loom.full(get(p)).clone()
        for stage in pipe.modules
        for name, p in zip(source_names(model, stage), stage.parameters(), strict=True)
    }


def _predicted(attention: str, dp: int, tp: int, microbatches: int, blocks: int) -> Counter:
    """`loom.cost.context`'s collectives of one attention call on a micro-batch (this rank's rows, the whole
    sequence), times the rank's layers and micro-batches."""
    formula = ulysses_collectives if attention == "ulysses" else ring_collectives
    one = formula(
        batch=BATCH // dp // microbatches, seq=SEQ, heads=CONFIG.n_heads // tp, kv_heads=CONFIG.kv_heads // tp,
        head_dim=CONFIG.head_dim, cp=2, dtype_bytes=4,
    )  # fmt: skip
    return Counter({key: n * blocks * microbatches for key, n in summary(one).items()})


def _assert_matches(results, case) -> None:
    schedule, attention, positions, dp, tp, microbatches = case
    expected, reference_grads, reference = _reference(positions, schedule)
    trained = set()
    for rank, (losses, grads, params, collectives, blocks) in enumerate(results):
        where = f"rank {rank}"
        assert collectives == _predicted(attention, dp, tp, microbatches, blocks), where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0, msg=where)
        for name, grad in grads.items():
            torch.testing.assert_close(
                grad, reference_grads[name], rtol=RTOL, atol=GRAD_ATOL, msg=f"{where}: {name}"
            )
        atol = param_atol(LR, STEPS, eps=1.0)
        for name, param in params.items():
            torch.testing.assert_close(param, reference[name], rtol=0, atol=atol, msg=f"{where}: {name}")
        trained |= set(params)
    assert trained == set(reference), "every parameter lives on some stage"


CASES = [  # (schedule, attention, positions, dp, tp, micro-batches)
    ("1f1b", "ulysses", "learned", 1, 1, 2),
    pytest.param(("1f1b", "ring", "rotary", 1, 1, 2), marks=pytest.mark.slow),
    pytest.param(("interleaved", "ring", "rotary", 1, 1, 2), marks=pytest.mark.slow),
    pytest.param(("zero_bubble", "ulysses", "rotary", 1, 1, 2), marks=pytest.mark.slow),
    pytest.param(("1f1b", "ring", "learned", 2, 1, 2), marks=pytest.mark.slow),
    pytest.param(("gpipe", "ulysses", "rotary", 1, 2, 2), marks=pytest.mark.slow),
    pytest.param(("1f1b", "ring", "rotary+moe", 2, 1, 2), marks=pytest.mark.slow),  # experts over ep 2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_context_parallel_pipeline_matches_one_device(dist_run, case):
    schedule, attention, positions, dp, tp, microbatches = case
    _assert_matches(dist_run(4 * dp * tp, cp_pipeline_case, *case), case)


@pytest.mark.slow
def test_loom_train_with_a_pipeline_and_cp_follows_one_device(dist_run, tmp_path):
    """The job `loom train` runs: `[parallel] pp = 2, cp = 2` (ring attention) gives one worker's losses."""
    one = job_config(tmp_path, parallel={"dp": 1}, train={"workers": 1, "steps": 3})
    parallel = {"dp": 1, "pp": 2, "cp": 2, "attention": "ring", "microbatches": 2}
    four = job_config(tmp_path, parallel=parallel, train={"workers": 4, "steps": 3})
    expected = dist_run(1, run, one)[0]["losses"]
    assert len(expected) == 3
    assert dist_run(4, run, four)[0]["losses"] == pytest.approx(expected, rel=RTOL)


def hf_refusal_case() -> str:
    mesh = loom.init({"pp": 2, "cp": 2})
    try:
        model_pipeline(build("gpt2"), mesh, schedule="1f1b", microbatches=2)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_config_with_cp_and_a_pipeline_is_accepted_and_hugging_face_pipelines_refuse_cp(dist_run):
    config = load_config(None, ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.microbatches", "2"])
    config.validate(4)
    plan = config.plan(4)
    assert (plan.pp, plan.cp, plan.dp) == (2, 2, 1)
    for message in dist_run(4, hf_refusal_case):
        assert "loom's GPT only (gpt_pipeline)" in message and "GPT2LMHeadModel with cp = 1" in message
