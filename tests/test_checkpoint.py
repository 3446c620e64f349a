"""Checkpoints: exact resume, integrity (fall back past corrupt checkpoints), resharding, export, CLI."""

import shutil
import types
import warnings
from unittest import mock

import pytest
import torch
from checkpoint_cases import CONFIG, GLOBAL_BATCH, setup

import loom
from loom.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    export_model,
    list_step_dirs,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    verify,
)
from loom.checkpoint.checkpointer import WRITE_HOOKS
from loom.cli.main import main as cli_main
from loom.models.gpt import GPT


def _steps(trainer, data, n):
    return [trainer.train_step([next(data)]).loss for _ in range(n)]


def _full_params(model):
    with model.loom.full_parameters():
        return {name: loom.full(p).clone() for name, p in model.named_parameters()}


def resume_case(root, dp, tp, level, k, n):
    model, trainer, data = setup(dp, tp, level)  # the run that never stops
    expected = _steps(trainer, data, n)
    reference = _full_params(model)
    model, trainer, data = setup(dp, tp, level)  # a run stopped after k steps
    first = _steps(trainer, data, k)
    save_checkpoint(root, trainer, data=data)
    rng = torch.get_rng_state()
    torch.manual_seed(1234)  # the resumed process starts with other generator states
    model, trainer, data = setup(dp, tp, level)
    step = load_checkpoint(root, trainer, data=data)
    rng_restored = torch.equal(torch.get_rng_state(), rng)
    resumed = _steps(trainer, data, n - k)
    final = _full_params(model)
    same = all(torch.equal(final[name], reference[name]) for name in reference)
    return {"step": step, "expected": expected, "got": first + resumed, "same": same, "rng": rng_restored}


@pytest.mark.parametrize(("dp", "tp", "level"), [(2, 2, 0), (2, 2, 1), (4, 1, 2), (2, 2, 3)])
def test_resume_is_bitwise_exact(dist_run, tmp_path, dp, tp, level):
    for result in dist_run(4, resume_case, str(tmp_path), dp, tp, level, 3, 6):
        assert result["step"] == 3
        assert result["got"] == result["expected"]  # bitwise: the same floats
        assert result["same"] and result["rng"]


def save_two_case(root):
    model, trainer, data = setup(2, 1, 0)
    saver = Checkpointer(root, every_steps=2, keep_last=2, data=data)
    for _ in range(6):
        trainer.train_step([next(data)])
        saver.maybe_save(trainer)
    saver.wait()  # old checkpoints are pruned in the background
    return _full_params(model)


def load_case(root):
    model, trainer, data = setup(2, 1, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = load_checkpoint(root, trainer, data=data)
    return {"step": step, "warnings": [str(w.message) for w in caught], "data": data.state_dict()}


@pytest.fixture(scope="module")
def two_checkpoints(dist_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    dist_run(2, save_two_case, str(root))
    return root


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _shard(step_dir, rank):
    return step_dir / "dcp" / f"__{rank}_0.distcp"


DAMAGE = {
    "flipped byte": (lambda d: _flip_byte(_shard(d, 0)), "__0_0.distcp", "checksum mismatch"),
    "deleted shard": (lambda d: _shard(d, 1).unlink(), "__1_0.distcp", "missing"),
    "truncated manifest": (
        lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:40]),
        "manifest.json",
        "truncated",
    ),
}


def test_keeps_the_last_k(two_checkpoints):
    assert [step for step, _ in list_step_dirs(two_checkpoints)] == [4, 6]
    assert all(not verify(path) for _, path in list_step_dirs(two_checkpoints))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_falls_back(dist_run, two_checkpoints, tmp_path, damage):
    root = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, root)
    hurt, file_name, problem = DAMAGE[damage]
    hurt(root / "step_000006")
    result, _ = dist_run(2, load_case, str(root))
    assert result["step"] == 4
    assert result["data"]["index"] == 4 * GLOBAL_BATCH
    assert any(file_name in w and problem in w and "step_000006" in w for w in result["warnings"]), result


def test_no_intact_checkpoint_is_an_error(dist_run, two_checkpoints, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, root)
    for _, path in list_step_dirs(root):
        (path / "manifest.json").unlink()
    with pytest.raises(Exception, match="no intact checkpoint"):
        dist_run(2, load_case, str(root))


class _BrokenData:
    def state_dict(self):
        raise OSError("disk full")


def failing_save_case(root):
    model, trainer, data = setup(2, 1, 0)
    trainer.train_step([next(data)])
    save_checkpoint(root, trainer, data=data)
    trainer.train_step([next(data)])
    try:
        save_checkpoint(root, trainer, data=_BrokenData())
    except CheckpointError as error:
        return str(error)
    return None


def test_failed_save_leaves_earlier_checkpoints(dist_run, tmp_path):
    errors = dist_run(2, failing_save_case, str(tmp_path))
    assert all(error is not None and "disk full" in error for error in errors), errors
    assert [step for step, _ in list_step_dirs(tmp_path)] == [1]
    assert not verify(tmp_path / "step_000001")


def unexplained_write_failure_case(root):
    """A save whose archive writer fails the way torch's does when the disk fills ("unexpected pos"), on a
    file system that reports almost no free space."""
    model, trainer, data = setup(2, 1, 0)
    _steps(trainer, data, 1)

    def short_write(step, temp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    WRITE_HOOKS.append(short_write)
    try:
        with mock.patch("shutil.disk_usage", return_value=types.SimpleNamespace(total=2**32, free=2**20)):
            save_checkpoint(root, trainer)
    except CheckpointError as error:
        return str(error)
    finally:
        WRITE_HOOKS.remove(short_write)
    return None


def test_a_save_failing_on_a_full_disk_says_the_disk_is_full(dist_run, tmp_path):
    errors = dist_run(2, unexplained_write_failure_case, str(tmp_path))
    for error in errors:
        assert "unexpected pos" in error and "earlier checkpoints are intact" in error
        assert f"the file system holding {tmp_path} is full (1 MiB free of 4.0 GiB)" in error, error
        assert "keep_last" in error and "checkpoint.dir" in error


def save_error_policy_case(root, policy):
    """A Checkpointer (every step) whose step-2 save fails on rank 1: stop, or warn and train on."""
    model, trainer, data = setup(2, 1, 0)
    checkpointer = Checkpointer(root, every_steps=1, keep_last=5, on_save_error=policy)
    trainer.callbacks.append(checkpointer)

    def disk_full(step, temp):
        if step == 2 and loom.rank() == 1:
            raise OSError(28, "No space left on device")

    WRITE_HOOKS.append(disk_full)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                trainer.train_step([next(data)])
    except CheckpointError as error:
        return trainer.step, str(error), []
    finally:
        WRITE_HOOKS.remove(disk_full)
    return trainer.step, None, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_failed_save_stops_or_continues_as_configured(dist_run, tmp_path, policy):
    results = dist_run(2, save_error_policy_case, str(tmp_path), policy)
    steps = [step for step, _ in list_step_dirs(tmp_path)]
    if policy == "stop":
        assert all(step == 2 and "No space left" in error for step, error, _ in results)
        assert steps == [1]
    else:
        (step, error, warned), (other_step, _, _) = results
        assert step == other_step == 3 and error is None
        assert len(warned) == 1 and "saving step 2" in warned[0] and "training continues" in warned[0]
        assert steps == [1, 3]
    assert all(not verify(tmp_path / f"step_{step:06d}") for step in steps)


def reshard_save_case(root):
    model, trainer, data = setup(4, 1, 0)
    _steps(trainer, data, 2)
    save_checkpoint(root, trainer, data=data)
    return _full_params(model)


def reshard_load_case(root):
    model, trainer, data = setup(2, 2, 0)
    load_checkpoint(root, trainer, data=data)
    exp_avg = {
        name: loom.full(trainer.optimizer.state[p]["exp_avg"]).clone() for name, p in model.named_parameters()
    }
    return _full_params(model), exp_avg, trainer.step


def reshard_reference_case(root):
    model, trainer, data = setup(4, 1, 0)
    load_checkpoint(root, trainer, data=data)
    return {
        name: loom.full(trainer.optimizer.state[p]["exp_avg"]).clone() for name, p in model.named_parameters()
    }


def test_reshard_dp4_to_dp2_tp2_and_one_device(dist_run, tmp_path):
    saved = dist_run(4, reshard_save_case, str(tmp_path))[0]
    params, exp_avg, step = dist_run(4, reshard_load_case, str(tmp_path))[0]
    assert step == 2
    assert all(torch.equal(params[name], saved[name]) for name in saved)
    reference_avg = dist_run(4, reshard_reference_case, str(tmp_path))[0]
    assert all(torch.equal(exp_avg[name], reference_avg[name]) for name in reference_avg)
    single = GPT(CONFIG)  # one process, no mesh
    load_model_weights(tmp_path / "step_000002", single)
    assert all(torch.equal(p, saved[name]) for name, p in single.named_parameters())
    out = tmp_path / "model.pt"
    export_model(tmp_path / "step_000002", out)
    exported = torch.load(out)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    assert cli_main(["checkpoint", "ls", str(tmp_path)]) == 0
