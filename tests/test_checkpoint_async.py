"""Background checkpoint saves (`Checkpointer(async_save=True)`): the same checkpoint as a synchronous save
of the step although training runs on while it is written, exact resume, invisible until complete, and
failures reported on every rank with the earlier checkpoints intact."""

import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_cases import setup
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor.debug import CommDebugMode

from loom.checkpoint import (
    Checkpointer,
    CheckpointError,
    latest_valid,
    list_step_dirs,
    load_checkpoint,
    read_model_tensors,
    save_checkpoint,
    verify,
    worker,
)
from loom.checkpoint import checkpointer as ckpt
from loom.checkpoint import manifest as mf
from loom.dist import env
from loom.dist.comm import collective_counts

# A hung save fails the test in a minute rather than the pool's five.
TIMEOUT_S = 90


@contextmanager
def _held_writes(gate: threading.Event | None = None, fail_on_rank: int | None = None):
    """DCP's background writes wait for `gate` (or raise on rank `fail_on_rank`); writes in the training
    thread (synchronous saves) pass."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if threading.current_thread() is not threading.main_thread():
            if env.rank() == fail_on_rank:
                raise OSError(f"no space left on rank {fail_on_rank}")
            if gate is not None:
                gate.wait()
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data
    try:
        yield
    finally:
        FileSystemWriter.write_data = original


@contextmanager
def _write_hook(hook):
    ckpt.WRITE_HOOKS.append(hook)
    try:
        yield
    finally:
        ckpt.WRITE_HOOKS.remove(hook)


def _steps(trainer, data, n):
    return [trainer.train_step([next(data)]).loss for _ in range(n)]


def _batches(data):
    return ([next(data)] for _ in iter(int, 1))


def overlap_case(root, dp, tp, level):
    """After step 2 a synchronous save (the reference), then a background save of the same step whose
    writes are held back while steps 3 and 4 update parameters and optimizer states in place."""
    model, trainer, data = setup(dp, tp, level)
    _steps(trainer, data, 2)
    save_checkpoint(f"{root}/sync", trainer, data=data)
    saver = Checkpointer(f"{root}/async", every_steps=2, async_save=True, data=data)
    published, gate = [], threading.Event()

    def record(step, temp):  # this rank's files (and rank 0's manifest) are complete: visible yet?
        published.append(
            ((temp.parent / f"step_{step:06d}").exists(), latest_valid(temp.parent, warn=False).step)
        )

    with _held_writes(gate), _write_hook(record):
        saver.maybe_save(trainer)
        polls = []
        for _ in range(2):
            trainer.train_step([next(data)])
            polls.append(saver.poll())
        pending = saver.pending_step
        visible = (saver.directory / "step_000002").exists()
        gate.set()
        saver.wait()
    return {
        "polls": polls, "pending": pending, "visible": visible, "published_at_hook": published,
        "last": saver.last_saved_step, "blocking": saver.last_blocking_s,
    }  # fmt: skip


def _dcp_contents(step_dir):
    """Every tensor and Python value DCP saved in `step_dir` (model and optimizer), by key."""
    reader = FileSystemReader(Path(step_dir) / "dcp")
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in metadata.items()
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _bitwise_equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(("dp", "tp", "level"), [(1, 2, 0), (2, 1, 1), (2, 1, 3)])
def test_background_save_equals_the_synchronous_one(dist_run, tmp_path, dp, tp, level):
    for result in dist_run(2, overlap_case, str(tmp_path), dp, tp, level, timeout=TIMEOUT_S):
        assert result["polls"] == [None, None] and result["pending"] == 2  # still writing during steps 3-4
        assert not result["visible"] and result["published_at_hook"] == [(False, None)]
        assert result["last"] == 2 and result["blocking"] is not None
    sync, background = tmp_path / "sync" / "step_000002", tmp_path / "async" / "step_000002"
    assert not verify(background)
    expected, got = _dcp_contents(sync), _dcp_contents(background)
    assert sorted(got) == sorted(expected) and any(key.startswith("optim.state.") for key in got)
    assert all(_bitwise_equal(got[key], expected[key]) for key in expected)
    model = read_model_tensors(background)
    assert all(torch.equal(model[name], tensor) for name, tensor in read_model_tensors(sync).items())
    for name in ("train_state.pt", "rank_00000.pt", "rank_00001.pt", "plan.json"):
        assert (background / name).read_bytes() == (sync / name).read_bytes(), name


def resume_case(root, level):
    model, trainer, data = setup(2, 1, level)  # the run that never stops
    expected = _steps(trainer, data, 5)
    model, trainer, data = setup(2, 1, level)  # saves step 2 in the background, stops after step 3
    saver = Checkpointer(root, every_steps=2, async_save=True, data=data)
    trainer.callbacks.append(saver)
    first = [metrics.loss for metrics in trainer.fit(_batches(data), 3)]
    published = (saver.pending_step, saver.last_saved_step)
    torch.manual_seed(1234)  # the resumed process starts with other generator states
    model, trainer, data = setup(2, 1, level)
    step = load_checkpoint(root, trainer, data=data)
    resumed = _steps(trainer, data, 3)
    return {"expected": expected, "first": first, "published": published, "step": step, "resumed": resumed}


def test_resume_from_a_background_save_is_bitwise_exact(dist_run, tmp_path):
    for result in dist_run(2, resume_case, str(tmp_path), 1, timeout=TIMEOUT_S):
        assert result["published"] == (None, 2) and result["step"] == 2
        assert result["first"] == result["expected"][:3]
        assert result["resumed"] == result["expected"][2:]  # bitwise: the same floats


def _failing_hook(step, temp):
    if step == 4 and env.rank() == 1:
        raise OSError("disk full on rank 1")


def failing_case(root):
    """Step 2 saved; step 4's write hook fails on rank 1; step 6's DCP write fails on rank 1 in the
    background; an exception stops training while step 8 is written; step 10 is saved; saving step 10
    again fails on rank 0 before its background write starts."""
    model, trainer, data = setup(2, 1, 0)
    saver = Checkpointer(root, every_steps=2, keep_last=5, async_save=True, data=data)
    trainer.callbacks.append(saver)
    errors = []
    with _write_hook(_failing_hook):
        try:
            trainer.fit(_batches(data), 5)  # reported at a step end, or at the end of training
        except CheckpointError as error:
            errors.append(str(error))
    with _held_writes(fail_on_rank=1):
        trainer.train_step([next(data)])  # step 6, saved in the background by the callback
        try:
            saver.wait()
        except CheckpointError as error:
            errors.append(str(error))
    gate = threading.Event()
    with _held_writes(gate):
        trainer.callbacks.append(_StopAt(8))
        with pytest.raises(RuntimeError, match="stopped"), pytest.warns(match="not published"):
            trainer.fit(_batches(data), 3)  # step 8 starts in the background, then training stops
        abandoned = saver.pending_step
        gate.set()
    trainer.callbacks.pop()
    _steps(trainer, data, 2)  # step 10 is saved in the background by the callback
    saver.wait()
    try:  # rank 0 cannot write the data position: every rank learns it before any background write starts
        Checkpointer(root, async_save=True, data=_BrokenData()).start(trainer)
    except CheckpointError as error:
        errors.append(str(error))
    return {"errors": errors, "last": saver.last_saved_step, "abandoned": abandoned}


class _BrokenData:
    def state_dict(self):
        raise OSError("cannot read the data position")


class _StopAt:
    """A callback that fails training after step `step` (on every rank)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, metrics):
        if trainer.step == self.step:
            raise RuntimeError(f"stopped after step {trainer.step}")


def test_failed_background_save_is_reported_everywhere(dist_run, tmp_path):
    for result in dist_run(2, failing_case, str(tmp_path), timeout=TIMEOUT_S):
        hook_error, write_error, start_error = result["errors"]
        assert "step 4" in hook_error and "disk full on rank 1" in hook_error
        assert "step 6" in write_error and "no space left on rank 1" in write_error
        assert "step 10" in start_error and "rank 0: OSError: cannot read the data position" in start_error
        assert result["abandoned"] is None and result["last"] == 10
    assert [step for step, _ in list_step_dirs(tmp_path)] == [2, 10]
    assert all(not verify(path) for _, path in list_step_dirs(tmp_path))


def no_collective_while_pending_case(root):
    """The collectives the checkpointer issues at each step end while a background save is held pending."""
    _, trainer, data = setup(2, 1, 1)
    saver = Checkpointer(root, every_steps=3, async_save=True, data=data)
    _steps(trainer, data, 3)
    gate = threading.Event()
    counts = []
    with _held_writes(gate):
        saver.maybe_save(trainer)  # step 3: the save starts
        for _ in range(2):  # steps 4 and 5: not due
            _steps(trainer, data, 1)
            with CommDebugMode() as comm:
                saver.maybe_save(trainer)
            counts.append(collective_counts(comm))
        pending = saver.pending_step
        gate.set()
        published = saver.wait()
    return {"counts": counts, "pending": pending, "published": published}


def test_no_collective_per_step_while_a_save_is_pending(dist_run, tmp_path):
    for result in dist_run(2, no_collective_while_pending_case, str(tmp_path), timeout=TIMEOUT_S):
        assert result["counts"] == [{}, {}] and result["pending"] == 3
        assert result["published"] == tmp_path / "step_000003"
    assert not verify(tmp_path / "step_000003")


def stopped_write_case(root):
    """Training fails while step 2 is written in the background (its writes held back, then released)."""
    _, trainer, data = setup(2, 1, 0)
    saver = Checkpointer(root, every_steps=2, async_save=True, data=data)
    trainer.callbacks += [saver, _StopAt(2)]
    gate = threading.Event()
    with _held_writes(gate):
        with pytest.raises(RuntimeError, match="stopped"), pytest.warns(match="not published"):
            trainer.fit(_batches(data), 3)
        gate.set()
        worker.settle()
    temp = Path(root) / ".tmp_step_000002" / "dcp"
    return {"pending": saver.pending_step, "metadata": (temp / ".metadata").exists(), "temp": temp.is_dir()}


def test_a_background_write_is_stopped_after_an_exception(dist_run, tmp_path):
    """The write of a save pending when training fails stops: DCP never completes it (no `.metadata`),
    nothing is published."""
    for result in dist_run(2, stopped_write_case, str(tmp_path), timeout=TIMEOUT_S):
        assert result == {"pending": None, "metadata": False, "temp": True}
    assert list_step_dirs(tmp_path) == []


def pruning_case(root):
    """Synchronous saves every step, keeping one: the threads the pruning ran in (rank 0)."""
    _, trainer, data = setup(2, 1, 0)
    saver = Checkpointer(root, every_steps=1, keep_last=1, data=data)
    threads = []
    original = mf.prune

    def prune(*args):
        threads.append(threading.current_thread().name)
        return original(*args)

    mf.prune = prune
    try:
        for _ in range(3):
            _steps(trainer, data, 1)
            saver.maybe_save(trainer)
        saver.wait()
    finally:
        mf.prune = original
    return threads


def test_pruning_runs_off_the_training_thread(dist_run, tmp_path):
    threads, others = dist_run(2, pruning_case, str(tmp_path))
    assert len(threads) == 3 and all(name.startswith("loom-checkpoint") for name in threads), threads
    assert others == []  # rank 0 prunes
    assert [step for step, _ in list_step_dirs(tmp_path)] == [3]
