"""Tier 2: a pipeline's data-parallel gradient reduction overlaps each stage's last backward pass.

dp=2 x pp=2 on 4 ranks, tied embeddings (their copies summed on the ranks that hold one), two accumulated
batches a step, small buckets (several per stage): under every schedule (gpipe, 1f1b, interleaved,
zero_bubble, zbv) the run gives one device's losses, gradient norms and parameters (Lipschitz AdamW, see
`equivalence`), and the event order shows each stage's first bucket reduction starting while that stage's
last backward pass of the step (its last weight-gradient pass in a zero-bubble schedule) still runs, and
none in the batches before. The reduction has one path: every collective of a step on gradients is a
`GradSync` bucket's (plus its one usage agreement), and the loss takes one collective per step however many
batches it accumulates.
"""

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from equivalence import ADAMW
from pipeline_cases import assert_matches_one_device, build, train
from test_pipeline_equivalence import CONFIG

import loom
from loom.models.gpt import GPT
from loom.parallel import make_optimizer
from loom.parallel.grad_sync import Bucket
from loom.parallel.pipeline import SCHEDULES, split_gpt
from loom.parallel.pipeline.stages import balanced_partition
from loom.train.data import micro_batches
from loom.train.trainer import Trainer

TIED = dataclasses.replace(CONFIG, tie_embeddings=True)
ACCUM = 2  # batches a step: only the last one's backward passes reduce
BUCKET_MB = 2e-3  # about 2 KB: several buckets per stage of this tiny GPT


def _log_events(pipe, log: list) -> None:
    """Record into `log`, in order: each backward and weight-gradient pass of each stage (start and end, with
    the schedule's `last_backward`), each batch, and each gradient bucket's reduction start."""
    for stage in pipe.stages:
        for name in ("backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(stage, name)

            def logged(chunk, *args, _original=original, _stage=stage.stage_index, **kwargs):
                last = kwargs.get("last_backward", False)
                log.append(("start", _stage, last))
                result = _original(chunk, *args, **kwargs)
                log.append(("end", _stage, last))
                return result

            setattr(stage, name, logged)
    run = pipe.run

    def batch(*args, **kwargs):
        log.append(("batch", kwargs.get("sync")))
        return run(*args, **kwargs)

    pipe.run = batch


def _launches_inside_last_passes(log: list) -> tuple[dict[int, int], int]:
    """Per stage: bucket reductions started while its last backward pass of the step ran; and how many
    started during a batch that does not reduce."""
    inside: dict[int, int] = {}
    running: list[tuple[int, bool]] = []
    syncing, early = False, 0
    for event in log:
        if event[0] == "batch":
            syncing = event[1]
        elif event[0] == "start":
            running.append(event[1:])
            inside.setdefault(event[1], 0)
        elif event[0] == "end":
            running.pop()
        elif not syncing:
            early += 1
        elif running and running[-1][1]:
            inside[running[-1][0]] += 1
    return inside, early


def overlap_case(schedule: str, virtual: int):
    model, pipe, rows = build(TIED, schedule=schedule, pp=2, dp=2, virtual=virtual, bucket_mb=BUCKET_MB)
    log: list = []
    _log_events(pipe, log)
    orders = []
    step = Trainer.train_step
    launch = Bucket.launch

    def logged_step(trainer, batches):
        log.clear()
        metrics = step(trainer, batches)
        orders.append(_launches_inside_last_passes(log))
        return metrics

    def logged_launch(bucket, *args, **kwargs):
        log.append(("launch",))
        return launch(bucket, *args, **kwargs)

    Trainer.train_step, Bucket.launch = logged_step, logged_launch
    try:
        result = train(model, pipe, rows, accum=ACCUM)
    finally:
        Trainer.train_step, Bucket.launch = step, launch
    return result, orders, len(pipe.grad_sync.buckets)


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2), ("zbv", 2)]


@pytest.mark.parametrize(("schedule", "virtual"), CASES, ids=[s for s, _ in CASES])
def test_the_reduction_overlaps_the_last_backward_and_matches_one_device(dist_run, schedule, virtual):
    results = dist_run(4, overlap_case, schedule, virtual)
    assert_matches_one_device([result for result, _, _ in results], TIED, ACCUM)
    for _, orders, buckets in results:
        assert buckets >= 2 * virtual, "several buckets per stage"
        assert len(orders) == 3
        for inside, early in orders:  # every step
            assert early == 0, "the first batch of a step reduces nothing"
            assert inside and all(count >= 1 for count in inside.values()), inside


# ---- exactly one reduction path -------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor")


def _caller() -> str:
    """The loom module that issued the collective being called."""
    root = Path(loom.__file__).parent
    for frame in inspect.stack()[2:]:
        path = Path(frame.filename)
        if root in path.parents:
            return f"{path.relative_to(root)}:{frame.function}"
    return "elsewhere"


def one_path_case(dp: int, tp: int):
    _, pipe, rows = build(TIED, schedule="1f1b", pp=2, dp=dp, tp=tp)
    trainer = Trainer(pipe, make_optimizer(pipe, torch.optim.AdamW, 0, **ADAMW), grad_accum=ACCUM)
    trainer.train_step(micro_batches(rows[0], ACCUM))  # DTensor routes are learnt in the first step
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(f"{name} from {_caller()}")
            return saved[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        trainer.train_step(micro_batches(rows[1], ACCUM))
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)
    shared_tables = all(
        stage.part("causal_mask") is pipe.modules[0].part("causal_mask") for stage in pipe.modules
    )
    return calls, len(pipe.grad_sync.buckets), shared_tables, any(s.copy_output for s in pipe.modules)


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)], ids=["dp2-pp2", "tp2-pp2"])
def test_a_pipeline_step_reduces_gradients_one_way(dist_run, dp, tp):
    """A step of two accumulated batches: its gradient collectives are the GradSync's buckets and one usage
    agreement; the loss takes one all-reduce, the gradient norm one; nothing else. (And 1F1B's stages send
    their outputs uncopied; stages read the model's causal mask, not copies of it.)"""
    for calls, buckets, shared_tables, copies in dist_run(4, one_path_case, dp, tp):
        assert shared_tables and not copies
        expected = {
            "all_reduce from parallel/grad_sync.py:launch": buckets,
            "all_reduce from parallel/grad_sync.py:_agree": 1,
            "all_reduce from parallel/pipeline/schedule.py:global_loss": 1,
            "all_reduce from parallel/grads.py:global_grad_norm": 1,
        }
        assert {call: calls.count(call) for call in calls} == expected, calls


def test_stages_read_the_models_constant_tables():
    """Every stage of a split GPT reads the model's causal mask and rotary tables (no copies)."""
    model = GPT(dataclasses.replace(CONFIG, positions="rotary"))
    for stage in split_gpt(model, balanced_partition([1] * CONFIG.n_layers, 4)):
        assert stage.part("causal_mask") is model.causal_mask
        assert stage.part("rope_cos") is model.rope_cos and stage.part("rope_sin") is model.rope_sin


def test_only_zero_bubble_schedules_copy_stage_outputs():
    assert {name for name, kind in SCHEDULES.items() if kind.split_backward} == {"zero_bubble", "zbv"}
