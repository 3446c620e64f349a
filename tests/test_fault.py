"""Failure detection and recovery: heartbeats, the supervisor's restarts, the non-finite guard, and tier-3
runs of the main job killed (SIGKILL, mid-step and mid-save), hung and poisoned on purpose, each finishing
on its own with the parameters of the run that never failed (bitwise, fp32 on CPU)."""

import json
import os
import random
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from equivalence import assert_params_close
from fault_cases import HEARTBEAT_TIMEOUT_S, beat_then_hang, silent_in_first_attempt, slow_start_then_hang
from job_cases import job_config
from torch import nn

from loom.checkpoint import read_model_tensors
from loom.cli.main import main
from loom.cli.train import restart_policy
from loom.dist.env import restart_count
from loom.dist.launch import WorkerDiedError, WorkerError, WorkerGroup, WorkerHangError, heartbeat
from loom.fault import (
    Fault,
    NonFiniteGuard,
    NonFiniteRollback,
    RestartBudgetExceeded,
    RestartPolicy,
    supervise,
)
from loom.train.config import TrainConfig
from loom.train.job import STARTUP_PHASES, _startup_faults, run
from loom.train.metrics import StepMetrics
from loom.train.trainer import Trainer

STEPS = 6

# ---- heartbeats and the supervisor, on small functions -----------------------------------------------------


def test_silent_rank_is_taken_for_hung():
    with WorkerGroup(2) as group:
        # a missed hang ends in the task timeout instead (WorkerTimeoutError, not the WorkerHangError expected)
        with pytest.raises(WorkerHangError) as info:
            group.run(beat_then_hang, 1, heartbeat_timeout=HEARTBEAT_TIMEOUT_S, timeout=120)
        assert group.broken  # torn down by the hang, before the group is closed
    assert info.value.ranks == [1] and info.value.last_steps == {1: 3}
    assert "rank 1 after step 3" in str(info.value)


def _fails_in_first_attempt(kind: str) -> int:
    heartbeat(1)
    if restart_count() == 0 and int(os.environ["RANK"]) == 1:
        if kind == "exit":
            os._exit(7)
        raise RuntimeError("boom in step 1")
    return restart_count()


@pytest.mark.parametrize("kind", ["exit", pytest.param("raise", marks=pytest.mark.slow)])
def test_supervisor_restarts_after_a_failure(tmp_path, kind):
    events_file = tmp_path / "events.jsonl"
    lines = []
    policy = RestartPolicy(max_restarts=1, heartbeat_timeout_s=30, events_file=events_file)
    done = supervise(_fails_in_first_attempt, 2, kind, policy=policy, log=lines.append)
    assert done.results == [1, 1]  # the second attempt, told its number
    (event,) = done.events
    assert event.ranks == (1,) and event.step == 1 and event.kind == ("died" if kind == "exit" else "raised")
    assert "attempt 0: rank 1" in lines[0] and "restarting" in lines[0]
    assert json.loads(events_file.read_text())["kind"] == event.kind


def _always_dies() -> None:
    heartbeat(1)
    os._exit(1)


def test_restart_budget_is_enforced():
    with pytest.raises(RestartBudgetExceeded) as info:
        supervise(_always_dies, 2, policy=RestartPolicy(max_restarts=1), log=lambda line: None)
    assert len(info.value.events) == 2 and "more than its 1 restart" in str(info.value)


def _setup_error() -> None:
    heartbeat(phase="building the model")  # start-up beats do not make a setup error worth a retry
    raise ValueError("bad config")


def test_setup_errors_are_not_retried():
    lines = []
    with pytest.raises(WorkerError, match="bad config"):
        supervise(_setup_error, 2, policy=RestartPolicy(max_restarts=3), log=lines.append)
    assert lines == []


def test_start_up_phases_beat_and_a_start_up_hang_is_caught():
    with WorkerGroup(2) as group:
        with pytest.raises(WorkerHangError) as info:  # not in "warming up": it kept beating
            group.run(slow_start_then_hang, 1, heartbeat_timeout=HEARTBEAT_TIMEOUT_S, timeout=120)
    assert info.value.ranks == [1] and info.value.last_steps == {1: None}
    assert "rank 1 in start-up phase 'loading the checkpoint'" in str(info.value)


def test_a_hang_before_the_first_heartbeat_is_restarted():
    lines = []
    policy = RestartPolicy(max_restarts=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    done = supervise(silent_in_first_attempt, 2, policy=policy, log=lines.append)
    assert done.results == [1, 1]
    (event,) = done.events
    assert event.kind == "hung" and event.ranks == (1,) and event.step is None
    assert "rank 1 at the start of the task" in event.cause
    assert "hung before its first step" in lines[0] and "restarting" in lines[0]


def test_start_up_faults_name_a_phase_of_the_job():
    with pytest.raises(ValueError, match="names its start-up phase"):
        Fault(kind="hang", rank=1, during="startup")
    with pytest.raises(ValueError, match="names its step"):
        Fault(kind="hang", rank=1, step=2, during="startup", phase="loading the checkpoint")
    with pytest.raises(ValueError, match="unknown start-up phase 'loading'"):
        _startup_faults([Fault(kind="hang", rank=1, during="startup", phase="loading")])
    assert set(STARTUP_PHASES) >= {"building the model", "loading the checkpoint"}


def test_died_error_names_the_last_step():
    with WorkerGroup(2) as group, pytest.raises(WorkerDiedError, match="last heartbeat: step 1"):
        group.run(_always_dies)


# ---- the Trainer skips non-finite steps ------------------------------------------------------------------------


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.linear(x) - y) ** 2).mean()


def test_trainer_skips_a_non_finite_step():
    torch.manual_seed(0)
    model = _Regression()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=1.0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    before = [p.detach().clone() for p in model.parameters()]
    bad = trainer.train_step([(x, y * float("inf"))])
    assert bad.skipped and trainer.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    good = trainer.train_step([(x, y)])
    assert not good.skipped and not torch.equal(before[0], model.linear.weight)


class _Position:
    """A data loader's position, for the guard's marker: the number of batches drawn."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict:
        return {"index": self.index}


def _guarded_run(
    skips: list[bool], reads_at, rollback_after: int, directory
) -> tuple[list[int], dict | None]:
    """Feed `NonFiniteGuard` steps skipped as `skips` says, their metrics deferred as the Trainer leaves
    them; returns the steps whose metrics were read and the rollback marker (None: no rollback)."""
    data, read = _Position(), []
    guard = NonFiniteGuard(rollback_after, directory, data, reads_at=reads_at)
    trainer = types.SimpleNamespace(step=0)
    try:
        for step, skipped in enumerate(skips, start=1):
            trainer.step, data.index = step, step
            settle = lambda step=step, skipped=skipped: read.append(step) or {"loss": 1.0, "skipped": skipped}  # noqa: E731
            metrics = StepMetrics.deferred(settle, torch.tensor(skipped), step=step, lr=0.1)
            guard.on_step_end(trainer, metrics)
    except NonFiniteRollback:
        return read, json.loads((directory / "rollback.json").read_text())
    return read, None


@pytest.mark.parametrize("every", [1, 4])
def test_the_guard_reads_the_device_only_where_the_run_does_and_rolls_back_alike(tmp_path, every):
    """The guard counts skipped steps on the device and reads the count at the steps `reads_at` names
    (a logged step, before a save): it reads no step's metrics, and rolls back to the marker that reading
    every step gives (the step that completed the streak, the data position after it)."""
    skips = [False, True, False, True, True, True, False, False]
    eager, marker = _guarded_run(skips, None, 3, tmp_path / "eager")
    assert eager == [] and marker["failed_at_step"] == 6 and marker["data"] == {"index": 6}
    read, deferred = _guarded_run(skips, lambda step: step % every == 0, 3, tmp_path / f"every_{every}")
    assert read == [] and deferred == marker
    _, none = _guarded_run(
        [True, True, False, True, True, False, True, True],
        lambda step: step % every == 0,
        3,
        tmp_path / "none",
    )
    assert none is None


def test_a_save_due_by_the_clock_is_due_for_the_guard_and_the_checkpointer_alike(tmp_path, monkeypatch):
    """The guard asks `due(step)` before the checkpointer does: the clock is read once per step, so that a
    minute passing between the two questions cannot make a save the guard did not read before."""
    from loom.checkpoint import periodic

    now = [0.0]
    monkeypatch.setattr(periodic.time, "monotonic", lambda: now[0])
    checkpointer = periodic.Checkpointer(tmp_path, every_minutes=1.0)
    now[0] = 59.0
    assert not checkpointer.due(5)
    now[0] = 61.0
    assert not checkpointer.due(5)  # the same step: the same answer
    assert checkpointer.due(6)


# ---- tier 3: the main job, killed, hung and poisoned ------------------------------------------------------------


def _config(tmp_path, name: str, **fault) -> TrainConfig:
    checkpoint = {"dir": str(tmp_path / name), "every_steps": 2, "keep_last": 10}
    return job_config(tmp_path, checkpoint=checkpoint, fault={"heartbeat_timeout_s": 20, **fault})


def _supervised(config: TrainConfig, faults=()):
    """As `loom train` supervises the job (its restart policy), with `faults` injected."""
    return supervise(
        run, config.train.workers, config, list(faults), policy=restart_policy(config), log=print
    )


def _final(config: TrainConfig) -> dict[str, torch.Tensor]:
    return read_model_tensors(f"{config.checkpoint.dir}/step_{STEPS:06d}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fault")
    config = _config(tmp_path, "clean")
    done = _supervised(config)
    assert done.events == [] and len(done.results[0]["losses"]) == STEPS
    return tmp_path, _final(config)


def _assert_same(final: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name


@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_sigkill_of_a_random_rank_at_a_random_step(uninterrupted, seed):
    tmp_path, expected = uninterrupted
    rng = random.Random(seed)
    fault = Fault(kind="sigkill", rank=rng.randrange(2), step=rng.randint(1, STEPS))
    config = _config(tmp_path, f"sigkill{seed}")
    done = _supervised(config, [fault])
    (event,) = done.events
    assert event.kind == "died" and "SIGKILL" in event.cause
    assert event.step == fault.step - 1  # it died inside the step after the last one it reported
    resumed = (fault.step - 1) // 2 * 2  # the newest checkpoint before it (one every 2 steps)
    assert len(done.results[0]["losses"]) == STEPS - resumed
    _assert_same(_final(config), expected)


def test_sigkill_while_writing_a_checkpoint(uninterrupted):
    tmp_path, expected = uninterrupted
    config = _config(tmp_path, "midsave")
    done = _supervised(config, [Fault(kind="sigkill", rank=1, step=4, during="save")])
    (event,) = done.events
    assert event.kind == "died" and event.step == 4
    # the half-written step 4 was never published, so the restart resumed from step 2
    assert len(done.results[0]["losses"]) == STEPS - 2
    _assert_same(_final(config), expected)


# slow: a silent rank after its steps is detected in test_silent_rank_is_taken_for_hung, a hang restarted in
# test_a_hang_before_the_first_heartbeat_is_restarted, and loom train's restart resumes as if uninterrupted in
# test_loom_train_restarts_after_an_injected_kill; this joins the three through loom train
@pytest.mark.slow
def test_hung_rank_is_detected_and_the_job_restarts(uninterrupted):
    tmp_path, expected = uninterrupted
    config = _config(tmp_path, "hang", heartbeat_timeout_s=8)
    done = _supervised(config, [Fault(kind="hang", rank=1, step=3)])
    (event,) = done.events
    assert event.kind == "hung" and event.step == 2
    _assert_same(_final(config), expected)


@pytest.mark.slow  # the supervisor's restart after a start-up hang: test_a_hang_before_the_first_heartbeat_is_restarted
def test_hang_while_loading_the_checkpoint_is_detected_and_the_job_restarts(uninterrupted):
    tmp_path, expected = uninterrupted
    config = _config(tmp_path, "starthang", heartbeat_timeout_s=15)
    done = _supervised(config, [Fault(kind="hang", rank=1, during="startup", phase="loading the checkpoint")])
    (event,) = done.events
    assert event.kind == "hung" and event.step is None  # before its first step
    # rank 0 waits for rank 1 in the load's first collective: either may be the first found silent
    assert "start-up phase 'loading the checkpoint'" in event.cause
    assert len(done.results[0]["losses"]) == STEPS  # no checkpoint yet: the restart trained from step 0
    _assert_same(_final(config), expected)


def test_non_finite_steps_roll_back_and_skip_their_data(uninterrupted):
    tmp_path, clean = uninterrupted
    config = _config(tmp_path, "nan", rollback_after=2)
    done = _supervised(config, [Fault(kind="nan", rank=0, step=3, repeat=2)])
    (event,) = done.events
    assert event.kind == "rollback" and event.step == 4
    marker = json.loads((tmp_path / "nan" / "rollback.json").read_text())
    assert marker["checkpoint_step"] == 2 and marker["failed_at_step"] == 4
    losses = done.results[0]["losses"]  # the attempt after the rollback: steps 3..6 on fresh data
    assert len(losses) == STEPS - 2 and all(np.isfinite(losses))
    final = _final(config)
    assert all(torch.isfinite(t).all() for t in final.values())
    # re-running steps 3..6 on the same batches would give the clean run's parameters bitwise
    assert any(not torch.equal(final[name], tensor) for name, tensor in clean.items())


# ---- tier 3 through the command line: `loom train` supervising, and torchrun restarting ---------------------


def _write_toml(config: TrainConfig, path) -> None:
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items() if value is not None]
    path.write_text("\n".join(lines) + "\n")


def test_loom_train_restarts_after_an_injected_kill(uninterrupted, monkeypatch, capfd):
    tmp_path, expected = uninterrupted
    config = _config(tmp_path, "cli")
    _write_toml(config, tmp_path / "cli.toml")
    monkeypatch.setenv("LOOM_FAULTS", '[{"kind": "exit", "rank": 0, "step": 5}]')
    assert main(["train", str(tmp_path / "cli.toml")]) == 0
    out = capfd.readouterr().out
    assert "attempt 0: rank 0 died after step 4" in out and "resumed from" in out
    (event,) = [json.loads(line) for line in (tmp_path / "cli" / "events.jsonl").read_text().splitlines()]
    assert event["kind"] == "died" and event["step"] == 4
    _assert_same(_final(config), expected)


@pytest.mark.slow  # torchrun itself: tests/test_cli_run.py::test_loom_init_under_plain_torchrun
def test_torchrun_restarts_the_job(uninterrupted):
    tmp_path, expected = uninterrupted
    config = _config(tmp_path, "torchrun")
    _write_toml(config, tmp_path / "torchrun.toml")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "-m", "loom.cli.main", "train", str(tmp_path / "torchrun.toml"),
    ]  # fmt: skip
    env = {**os.environ, "LOOM_FAULTS": '[{"kind": "sigkill", "rank": 1, "step": 3}]'}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout
    final = _final(config)
    # torchrun's workers run one thread each (loom's launcher shares the cores): same maths, other sums
    assert_params_close(final, expected, lr=config.train.lr, steps=STEPS)
