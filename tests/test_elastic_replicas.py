"""Replicas that come and go (`[fault] elastic_replicas`, loom.dist.elastic): `loom train`'s job under
`supervise_replicas` with `sync = "diloco"` or `"local_sgd"`, a replica SIGKILLed between two syncs through
`Fault` (what LOOM_FAULTS builds):

- the job ends without a restart: the survivor runs every step, the event (`replica_left`, rank, last step)
  is logged and written to the events file;
- the replacement joins at the next sync, where its weights and global weights equal the survivor's global
  weights exactly, and so they stay at every later sync (the outer state came with them); the losses are
  finite and fall;
- a replica killed in the step that ends with a sync is left out of that sync, which the others finish
  (slow: 3 ranks);
- settings elastic replicas refuse are errors naming the key (every-step sync stays a restart).
"""

import json
import math
import time

import pytest
import torch
from job_cases import job_config

from loom.cli.main import main
from loom.dist import elastic, launch
from loom.fault import Fault, RestartPolicy, supervise_replicas
from loom.parallel.local_sgd import DiLoCo, Replicated
from loom.train.job import run

EVERY = 3


def _config(tmp_path, sync: str, steps: int, workers: int = 2):
    return job_config(
        tmp_path,
        parallel={"dp": workers, "sync": sync, "sync_every": EVERY},
        train={"steps": steps, "workers": workers, "global_batch": 2 * workers},
        fault={"elastic_replicas": True},
    )


def _wait_for_replacement(step_after: int, timeout: float = 120.0):
    """A heartbeat hook for the workers of the job's start: after step `step_after`, wait until a
    replacement is on the roster, so that it joins at the next sync whatever the machine's load."""
    membership = elastic.membership()

    def hook(step, phase) -> None:
        if step != step_after or membership.joining:
            return
        deadline = time.monotonic() + timeout
        while not any(joins > 0 for _, joins in membership.members()):
            assert time.monotonic() < deadline, "no replacement joined the roster"
            time.sleep(0.05)

    return hook


def _recorded_run(config, faults, wait_after: int | None) -> dict:
    """`run` on this replica, recording after each sync its parameters and global weights (LocalSGD: the
    average, which is its parameters)."""
    synced: dict[int, dict] = {}
    original = Replicated.skip

    def skip(self) -> None:
        original(self)
        if self.inner_steps % self.sync_every == 0:
            params = [p.detach().clone() for p in self.params]
            weights = [w.clone() for w in self.global_weights] if isinstance(self, DiLoCo) else params
            synced[self.inner_steps] = {"params": params, "global": weights}

    def join(self, last_step):
        step = original_join(self, last_step)
        if step is not None:  # the joining sync ran inside join(), through _sync_due
            params = [p.detach().clone() for p in self.params]
            weights = [w.clone() for w in self.global_weights] if isinstance(self, DiLoCo) else params
            synced[step] = {"params": params, "global": weights}
        return step

    original_join = Replicated.join
    Replicated.skip, Replicated.join = skip, join
    hook = _wait_for_replacement(wait_after) if wait_after is not None else None
    if hook is not None:
        launch.BEAT_HOOKS.append(hook)
    try:
        return {**run(config, faults), "synced": synced}
    finally:
        Replicated.skip, Replicated.join = original, original_join
        if hook is not None:
            launch.BEAT_HOOKS.remove(hook)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("sync", ["diloco", pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_a_killed_replica_is_replaced_without_a_restart(tmp_path, sync):
    steps, killed_at = 4 * EVERY, 5  # killed between the syncs of steps 3 and 6
    config = _config(tmp_path, sync, steps)
    events_file, lines = tmp_path / "events.jsonl", []
    policy = RestartPolicy(max_restarts=1, heartbeat_timeout_s=180, events_file=events_file)
    faults = [Fault(kind="sigkill", rank=1, step=killed_at)]
    done = supervise_replicas(_recorded_run, 2, config, faults, killed_at, policy=policy, log=lines.append)

    # no restart: one event, the replica's leaving, logged and recorded; the survivor ran every step
    assert [(e.kind, e.ranks, e.step) for e in done.events] == [("replica_left", (1,), killed_at - 1)]
    assert any(
        "rank 1 replica_left after step 4" in line and "joins at the next sync" in line for line in lines
    )
    recorded = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert [(e["kind"], e["ranks"], e["step"]) for e in recorded] == [("replica_left", [1], killed_at - 1)]
    survivor, joiner = done.results
    assert survivor["first_step"] == 1 and len(survivor["losses"]) == steps
    assert survivor["joined_at"] is None

    # the replacement joined at the next sync and trained the steps after it
    assert joiner["joined_at"] == 2 * EVERY and joiner["first_step"] == 2 * EVERY + 1
    assert len(joiner["losses"]) == steps - 2 * EVERY
    for step in (2 * EVERY, 3 * EVERY, 4 * EVERY):  # at the join and every sync after it: the same state
        mine, theirs = joiner["synced"][step], survivor["synced"][step]
        assert _equal(mine["params"], theirs["global"]), step
        assert _equal(mine["global"], theirs["global"]), step
    assert sorted(joiner["synced"]) == [2 * EVERY, 3 * EVERY, 4 * EVERY]  # it met at no earlier sync

    for summary in done.results:
        assert all(math.isfinite(loss) for loss in summary["losses"])
    losses = survivor["losses"]
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.slow  # 3 ranks, and a sync that waits for a member to leave
def test_a_replica_killed_in_a_sync_step_is_left_out_of_it(tmp_path):
    steps = 3 * EVERY
    config = _config(tmp_path, "diloco", steps, workers=3)
    # rank 2 dies in the step that ends with the sync of step 6: ranks 0 and 1 meet without it there
    faults = [Fault(kind="sigkill", rank=2, step=2 * EVERY)]
    policy = RestartPolicy(max_restarts=1, heartbeat_timeout_s=180)
    done = supervise_replicas(_recorded_run, 3, config, faults, None, policy=policy, log=print)
    assert [(e.kind, e.ranks) for e in done.events] == [("replica_left", (2,))]
    first, second, third = done.results
    assert len(first["losses"]) == len(second["losses"]) == steps
    for step in (EVERY, 2 * EVERY, 3 * EVERY):  # the survivors met at every sync, the one of step 6 too
        assert _equal(first["synced"][step]["global"], second["synced"][step]["global"]), step
    if third["joined_at"] is not None:  # the replacement may be ready for the last sync, or not
        assert third["joined_at"] == 3 * EVERY
        assert _equal(third["synced"][3 * EVERY]["params"], first["synced"][3 * EVERY]["global"])


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"parallel": {"sync": "every_step"}}, "parallel.sync"),
        ({"parallel": {"tp": 2, "dp": 1}}, "parallel.tp"),
        ({"parallel": {"fragments": 3}}, "parallel.fragments"),
        ({"checkpoint": {"dir": "ckpt"}}, "checkpoint.dir"),
    ],
)
def test_settings_elastic_replicas_refuse(tmp_path, sections, key):
    parallel = {"sync": "diloco", "sync_every": EVERY, **sections.get("parallel", {})}
    other = {k: v for k, v in sections.items() if k != "parallel"}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config = job_config(tmp_path, parallel=parallel, fault={"elastic_replicas": True}, **other)
        config.validate(2)


def test_elastic_replicas_need_a_second_replica_to_take_the_weights_from(tmp_path):
    with pytest.raises(ValueError, match=r"fault\.elastic_replicas = true with 1 replica \(parallel\.dp\)"):
        job_config(
            tmp_path,
            parallel={"dp": 1, "sync": "diloco", "sync_every": EVERY},
            train={"workers": 1, "global_batch": 2},
            fault={"elastic_replicas": True},
        ).validate(1)


@pytest.mark.slow  # a whole `loom train` with a replacement
def test_loom_train_with_a_replica_killed_through_loom_faults(tmp_path, capfd, monkeypatch):
    job_config(tmp_path)  # writes the token file
    config = tmp_path / "elastic.toml"
    config.write_text(
        f'[model]\nd_model = 32\nn_layers = 2\nn_heads = 2\nmax_seq_len = 16\n[data]\nkind = "tokens"\n'
        f'path = "{tmp_path / "tokens.bin"}"\nseq_len = 16\n[parallel]\ndp = 2\nsync = "diloco"\n'
        "sync_every = 5\n[train]\nsteps = 20\nglobal_batch = 4\nworkers = 2\neval_every = 0\n[fault]\n"
        "elastic_replicas = true\nheartbeat_timeout_s = 120\n"
    )
    monkeypatch.setenv("LOOM_FAULTS", '[{"kind": "sigkill", "rank": 1, "step": 7}]')
    assert main(["train", str(config)]) == 0
    out = capfd.readouterr().out
    assert "rank 1 replica_left after step 6: was killed by signal SIGKILL" in out, out
    assert "restarting" not in out and "20 steps: loss" in out


@pytest.mark.slow  # waits out a heartbeat timeout
def test_a_hung_replica_is_killed_and_replaced_while_the_other_waits_at_the_sync(tmp_path):
    steps = 4 * EVERY
    config = _config(tmp_path, "diloco", steps)
    faults = [Fault(kind="hang", rank=1, step=5, seconds=600)]  # silent from step 5 on
    policy = RestartPolicy(max_restarts=1, heartbeat_timeout_s=15, collective_timeout_s=60)
    done = supervise_replicas(_recorded_run, 2, config, faults, None, policy=policy, log=print)
    # rank 0 waited at the sync of step 6 beating, so only rank 1 was taken for hung
    assert [(e.kind, e.ranks, e.step) for e in done.events] == [("replica_left", (1,), 4)]
    assert "no heartbeat" in done.events[0].cause
    survivor, joiner = done.results
    assert len(survivor["losses"]) == steps and all(math.isfinite(x) for x in survivor["losses"])
    if joiner["joined_at"] is not None:  # ready for a later sync: it took the global weights there
        step = joiner["joined_at"]
        assert _equal(joiner["synced"][step]["params"], survivor["synced"][step]["global"])
