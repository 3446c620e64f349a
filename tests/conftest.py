"""Shared fixtures: a session-wide pool of initialised worker groups, one per world size.

Starting workers costs seconds (a torch import and a rendezvous per rank), so multi-rank tests send
their bodies to long-lived groups instead of spawning per test. Bodies are module-level functions of
the test files: they pickle by reference, and the workers import the test modules by name because
spawn hands them the parent's sys.path.

Start methods: the pool's long-lived groups, which run most of the suite's multi-rank work, are started
by "spawn", loom's default. The hundred or so throwaway workers of the launcher, fault and command-line
tests (each supervised restart starts its ranks again) are forked from a forkserver: about 2.7 s of CPU
saved per worker, two minutes of the suite on 2 cores. A `LOOM_START_METHOD` set by the caller is kept
for both (the suite runs whole under either method).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from loom.dist.launch import WorkerGroup


_CALLER_START_METHOD = os.environ.get("LOOM_START_METHOD")
if _CALLER_START_METHOD is None and sys.platform == "linux":
    os.environ["LOOM_START_METHOD"] = "forkserver"  # for the throwaway workers (see the module docstring)
    # most throwaway workers run training jobs: the server imports their modules once for all of them
    # (five launches of 2 workers that import loom.train.job: 26.7 s without, 3.6 s with, loaded machine)
    os.environ.setdefault("LOOM_FORKSERVER_PRELOAD", "loom.train.job")


@contextmanager
def _start_method(method: str) -> Iterator[None]:
    """`LOOM_START_METHOD=method` while the block starts workers."""
    before = os.environ.get("LOOM_START_METHOD")
    os.environ["LOOM_START_METHOD"] = method
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOOM_START_METHOD"]
        else:
            os.environ["LOOM_START_METHOD"] = before


class WorkerPool:
    """One `WorkerGroup` per world size, started on first use and replaced once broken."""

    def __init__(self) -> None:
        self._groups: dict[int, WorkerGroup] = {}

    def group(self, world_size: int) -> WorkerGroup:
        """The live group of `world_size` ranks (a fresh one when the last one broke)."""
        # Imported here, so that collecting the pure-Python tests never depends on the launcher.
        from loom.dist.launch import WorkerGroup

        group = self._groups.get(world_size)
        if group is None or group.broken:
            with _start_method(_CALLER_START_METHOD or "spawn"):
                group = self._groups[world_size] = WorkerGroup(world_size)
        return group

    def run(self, world_size: int, fn: Callable, /, *args: Any, timeout: float = 300, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on `world_size` ranks; return the results, index = rank."""
        return self.group(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        """Stop every group."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: long multi-rank or end-to-end test; deselect with -m 'not slow'"
    )


# With pytest-xdist (`make test` runs `-n 2 --dist loadgroup`), the tests that run on the pool form two xdist
# groups, each run whole by one process on a pool of its own, so that no two groups of the same pool compete
# for the cores. xdist hands the larger group to one process and the smaller to the other; the rest
# (one-process tests, and the launcher, fault and command-line tests, which start their own workers and
# spend much of their time waiting on them: restarts, heartbeat timeouts) fill in around them, wherever a
# process is free. The second group holds about a sixth of the pool's work, in files whose tests all run on
# 4 ranks and never import transformers (another group size, or a Hugging Face import, would cost each of its
# workers seconds of CPU). With one group, the process running it finished last by about 90 s (351 s against
# 264 s, fresh clone, idle); with the second group of two files, by 23 s (373 s against 350 s of test time,
# avx2), so two context-parallel files joined it.
POOL_GROUP = "worker_pool"
SECOND_POOL_GROUP = "worker_pool_2"
SECOND_POOL_FILES = {
    "test_train_equivalence.py",
    "test_pipeline_overlap.py",
    "test_context_parallel_training.py",
    "test_context_parallel_experts.py",
}


# tryfirst: xdist's own hook turns the marker into the test's group when it runs, so the marker must be
# on the item before then.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if {"dist_run", "worker_pool"} & set(getattr(item, "fixturenames", ())):
            group = SECOND_POOL_GROUP if item.path.name in SECOND_POOL_FILES else POOL_GROUP
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, fail at once if the pool's tests did not become their groups.

    xdist marks a test's group by a suffix on its id; a pytest that drops the suffix would let both
    processes start a pool and fight over the cores, silently, for a suite a minute slower.
    """
    if not session.config.getoption("loadgroup", default=False):
        return
    grouped = [(item, item.get_closest_marker("xdist_group")) for item in session.items]
    if not all(item.nodeid.endswith("@" + mark.args[0]) for item, mark in grouped if mark):
        raise pytest.UsageError(
            f"pytest-xdist did not group the worker pool's tests (pytest {pytest.__version__}); "
            "install the versions the `test` extra of pyproject.toml pins: `make setup`"
        )


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """The session's pool of worker groups (closed at the end of the session)."""
    pool = WorkerPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dist_run(worker_pool: WorkerPool) -> Callable[..., list]:
    """`dist_run(world_size, fn, *args, timeout=300, **kwargs) -> list`: fn's result on every rank.

    Generous default timeout: 8 ranks share 2 cores here.
    """
    return worker_pool.run
