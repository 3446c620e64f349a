"""Tier 2: loom.dist.launch and loom.dist.env: results by rank, collectives, and failures that leave no
worker process behind. Healthy bodies run on the session pool (`dist_run`); behaviour that belongs to
`launch` and `WorkerGroup` themselves (teardown, death, timeouts) uses them directly.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import loom
from loom.dist import env
from loom.dist import launch as launch_module
from loom.dist.launch import (
    LaunchError,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    launch,
)

# A hung rank sleeps this long; every test stops it much sooner, so the value only bounds a bug.
_HANG_S = 600


# ------------------------------------------------------------------ bodies (module level: they pickle)


def _rank_info() -> tuple:
    device_matches_backend = env.device_type() == ("cuda" if dist.get_backend() == "nccl" else "cpu")
    return env.rank(), env.world_size(), env.local_rank(), os.environ["RANK"], device_matches_backend


def _echo(pid_dir: str, a: int, *, b: int) -> tuple[int, int, int]:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    return dist.get_rank(), a, b


def _all_reduce_rank_ids() -> float:
    total = torch.tensor([float(dist.get_rank())], device=env.device_type())
    dist.all_reduce(total)
    return total.item()


def _ensure_twice_is_noop() -> bool:
    world = dist.group.WORLD
    env.ensure_process_group()
    env.ensure_process_group(backend="gloo")
    return dist.group.WORLD is world and dist.get_rank() == int(os.environ["RANK"])


def _raise_on(ranks: list[int]) -> int:
    if dist.get_rank() in ranks:
        raise ValueError(f"boom from rank {dist.get_rank()}")
    return dist.get_rank()


def _return_unpicklable() -> object:
    return threading.Lock()


def _act(pid_dir: str | None, actions: dict[int, str]) -> int:
    """Record this worker's pid, wait until every rank has, then do `actions[rank]` (default: return)."""
    rank = dist.get_rank()
    if pid_dir is not None:
        Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
        while len(list(Path(pid_dir).glob("*.pid"))) < dist.get_world_size():
            time.sleep(0.01)
    action = actions.get(rank, "return")
    if action == "exit3":
        os._exit(3)
    elif action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sleep":
        time.sleep(_HANG_S)
    elif action == "raise":
        raise RuntimeError(f"rank {rank} gave up")
    elif action == "all_reduce":  # waits forever when a peer never joins
        dist.all_reduce(torch.ones(1, device=env.device_type()))
    return rank


# ------------------------------------------------------------------ helpers


def _pids(pid_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in sorted(pid_dir.glob("*.pid"))]


def _assert_gone(pids: list[int]) -> None:
    """Every pid is gone: killed and reaped (a reaped child's pid no longer exists)."""
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------ healthy runs


def test_results_come_back_by_rank(dist_run):
    assert dist_run(2, _rank_info) == [(0, 2, 0, "0", True), (1, 2, 1, "1", True)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_rank_ids(dist_run, world_size):
    expected = float(sum(range(world_size)))
    assert dist_run(world_size, _all_reduce_rank_ids) == [expected] * world_size


def test_ensure_process_group_is_idempotent_in_workers(dist_run):
    assert dist_run(2, _ensure_twice_is_noop) == [True, True]


def test_pool_reuses_worker_processes(dist_run):
    first = dist_run(2, os.getpid)
    assert len(set(first)) == 2
    assert dist_run(2, os.getpid) == first


def test_launch_passes_arguments_and_stops_its_workers(tmp_path):
    assert launch(_echo, 2, str(tmp_path), 7, b=8, timeout=120) == [(0, 7, 8), (1, 7, 8)]
    _assert_gone(_pids(tmp_path))


def test_unpicklable_function_is_rejected_before_any_process_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot send .*<lambda> and its arguments"):
        launch(lambda: lock.locked(), 2)  # a lambda travels by value, but not the lock it closes over


# ------------------------------------------------------------------ worker errors


def test_worker_error_names_rank_type_message_and_traceback(dist_run, worker_pool):
    pids = dist_run(2, os.getpid)
    group = worker_pool.group(2)
    # A loaded machine may delay rank 0's answer; a generous grace keeps the survival check exact.
    group.error_grace, default_grace = 60.0, group.error_grace
    try:
        with pytest.raises(WorkerError) as info:
            dist_run(2, _raise_on, [1])
    finally:
        group.error_grace = default_grace
    error = info.value
    assert error.rank == 1 and error.failed_ranks == [1] and error.exc_type == "ValueError"
    assert "rank 1 raised ValueError" in str(error) and "boom from rank 1" in str(error)
    assert "in _raise_on" in error.traceback and error.traceback.rstrip() in str(error)
    assert isinstance(error.__cause__, ValueError)
    # The other rank returned promptly, so the group survives the error.
    assert dist_run(2, os.getpid) == pids


def test_several_failing_ranks_report_the_lowest_and_mention_the_others(dist_run):
    with pytest.raises(WorkerError, match=r"(?s)rank 0 raised ValueError.*also raised: rank 1") as info:
        dist_run(2, _raise_on, [0, 1])
    assert info.value.rank == 0 and info.value.failed_ranks == [0, 1]


def test_unpicklable_result_is_a_clear_error(dist_run):
    with pytest.raises(WorkerError, match="could not pickle its return value"):
        dist_run(2, _return_unpicklable)


def test_error_with_stuck_peers_tears_the_group_down(tmp_path):
    group = WorkerGroup(2, error_grace=0.5)
    try:
        with pytest.raises(WorkerError, match=r"(?s)rank 1 raised RuntimeError.*rank 0 had not answered"):
            group.run(_act, str(tmp_path), {0: "all_reduce", 1: "raise"}, timeout=120)
        assert group.broken
        _assert_gone(group.pids)
        with pytest.raises(LaunchError, match="cannot run tasks"):
            group.run(os.getpid)
    finally:
        group.close()


def test_start_retries_when_the_rendezvous_port_is_taken(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = [busy.getsockname()[1]]
        real_free_port = env.free_port
        monkeypatch.setattr(env, "free_port", lambda: ports.pop() if ports else real_free_port())
        with WorkerGroup(1) as group:  # rank 0 binds the port; one rank keeps the test cheap
            assert not ports  # the first attempt used the busy port
            assert group.run(_rank_info) == [(0, 1, 0, "0", True)]


# ------------------------------------------------------------------ deaths, timeouts, interrupts


def test_worker_exit_is_reported_and_the_pool_replaces_the_group(dist_run):
    before = dist_run(2, os.getpid)
    # Rank 0 hangs: only a death noticed at once (not the 120 s timeout) gives WorkerDiedError.
    with pytest.raises(WorkerDiedError, match="rank 1 exited with exit code 3") as info:
        dist_run(2, _act, None, {0: "sleep", 1: "exit3"}, timeout=120)
    assert info.value.rank == 1 and info.value.exitcode == 3
    _assert_gone(before)
    after = dist_run(2, os.getpid)
    assert not set(after) & set(before)


def test_worker_killed_by_a_signal_is_reported(tmp_path):
    with pytest.raises(WorkerDiedError, match="rank 0 was killed by signal SIGKILL") as info:
        launch(_act, 2, str(tmp_path), {0: "sigkill", 1: "sleep"}, timeout=120)
    assert info.value.rank == 0 and info.value.exitcode == -signal.SIGKILL
    _assert_gone(_pids(tmp_path))


def test_timeout_names_the_silent_ranks(tmp_path):
    # Rank 0 answers at once; a heavily loaded machine may still make it miss the deadline, hence "1 in".
    silent = r"rank.*\b1 did not answer within the timeout of 2 s"
    with pytest.raises(WorkerTimeoutError, match=silent) as info:
        launch(_act, 2, str(tmp_path), {1: "sleep"}, timeout=2)
    assert 1 in info.value.ranks and info.value.timeout == 2
    _assert_gone(_pids(tmp_path))


def test_keyboard_interrupt_in_the_caller_stops_the_workers():
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    group = WorkerGroup(2)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            group.run(_act, None, {0: "sleep", 1: "sleep"}, timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        group.close()
    assert group.broken
    _assert_gone(group.pids)


# ------------------------------------------------------------------ env in this (single) process


_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_single_process_gets_a_one_rank_group(monkeypatch):
    for name in _RENDEZVOUS_VARS:
        monkeypatch.delenv(name, raising=False)
    assert (env.rank(), env.world_size(), env.local_rank()) == (0, 1, 0)
    env.ensure_process_group()
    try:
        world = dist.group.WORLD
        env.ensure_process_group()
        assert dist.group.WORLD is world
        expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
        assert (env.rank(), env.world_size(), dist.get_backend()) == (0, 1, expected_backend)
        total = torch.tensor([5.0], device=env.device_type())
        dist.all_reduce(total)
        assert total.item() == 5.0
    finally:
        env.shutdown_process_group()
    assert not dist.is_initialized()


def test_partial_torchrun_environment_is_a_clear_error(monkeypatch):
    for name in _RENDEZVOUS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="not WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        env.ensure_process_group()
    assert not dist.is_initialized()


# ------------------------------------------------------------------ seeding, and the rendezvous store


def _draws() -> tuple:
    import random

    import numpy as np

    return torch.randn(3), random.random(), float(np.random.rand())


def test_launch_seeds_every_rank_alike(worker_pool):
    group = worker_pool.group(2)
    seeded = group._run_payload(launch_module._dump_task(_draws, (), {}, seed=5), "running _draws", 120)
    loom.seed(5)
    here = _draws()
    for draws in seeded:  # every rank drew what this process draws after loom.seed(5)
        assert torch.equal(draws[0], here[0]) and draws[1:] == here[1:]
    unseeded = group._run_payload(launch_module._dump_task(_draws, (), {}, seed=None), "running _draws", 120)
    assert not torch.equal(unseeded[0][0], here[0])  # seed=None: the generators go on, not reseeded


def _listening_addresses() -> list[str]:
    """The local addresses of the sockets that listen on MASTER_PORT, from /proc/net/tcp and tcp6."""
    port = f"{int(os.environ['MASTER_PORT']):04X}"
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, local_port = fields[1].rsplit(":", 1)
            if local_port == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_local_rendezvous_store_listens_on_loopback_only(dist_run):
    addresses = dist_run(2, _listening_addresses)[0]  # rank 0 hosts the store
    assert addresses == ["0100007F"]  # 127.0.0.1 only: not 0.0.0.0, not every IPv6 interface


@pytest.mark.parametrize(
    ("master_addr", "bound"),
    [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"), ("127.0.1.1", "127.0.1.1"), ("10.0.0.1", None),
     ("node0", None), ("::1", None)],
)  # fmt: skip
def test_only_a_literal_loopback_master_addr_binds_the_store_to_loopback(master_addr, bound):
    # Other addresses, and host names (which may name this machine to other nodes), keep env://'s binding.
    assert env._loopback_ipv4(master_addr) == bound


# ------------------------------------------------------------------ how workers start


def _start_facts() -> tuple:
    return os.environ.get("LOOM_TEST_MARK"), torch.get_num_threads(), os.getcwd()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_take_the_callers_environment_and_directory_as_they_start(monkeypatch, tmp_path, method):
    """Forked from a server that started earlier, a worker still sees the caller's environment, threads
    setting and directory of the moment it starts, as a spawned worker does."""
    monkeypatch.setenv("LOOM_START_METHOD", method)
    launch(_start_facts, 1)  # with forkserver, the server is up from here on (if it was not already)
    monkeypatch.setenv("LOOM_TEST_MARK", "after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    assert launch(_start_facts, 2) == [("after the server started", 1, str(tmp_path))] * 2


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_print_where_the_callers_output_goes_now(capfd, monkeypatch, method):
    monkeypatch.setenv("LOOM_START_METHOD", method)
    launch(print, 2, "hello from a worker")
    assert capfd.readouterr().out.count("hello from a worker") == 2


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_start_methods_run_the_same_task(monkeypatch, method):
    monkeypatch.setenv("LOOM_START_METHOD", method)
    assert launch(_rank_info, 2)[1][:2] == (1, 2)


def test_an_unknown_start_method_is_named(monkeypatch):
    monkeypatch.setenv("LOOM_START_METHOD", "fork")
    with pytest.raises(ValueError, match="LOOM_START_METHOD='fork': use 'forkserver'"):
        launch(_rank_info, 2)


def test_forkserver_preload_adds_the_modules_named_in_the_environment(monkeypatch):
    monkeypatch.setenv("LOOM_FORKSERVER_PRELOAD", " loom.train.job, ,json ")
    assert launch_module.forkserver_preload() == ["torch", "loom.dist.launch", "loom.train.job", "json"]
    monkeypatch.delenv("LOOM_FORKSERVER_PRELOAD")
    assert launch_module.forkserver_preload() == ["torch", "loom.dist.launch"]
