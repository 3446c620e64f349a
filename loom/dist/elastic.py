"""Replicas that come and go: workers that may die and be replaced while the others go on training.

Under `loom.fault.supervise_replicas` (`[fault] elastic_replicas = true` in `loom train`) every worker is a
process group of its own (world size 1) and one *slot* of the job: `Membership.rank` of `Membership.size`,
the index of its data-parallel replica. What the replicas share is a rendezvous store hosted by the
launcher, never by a worker, so that any worker may die:

- `members`: the workers alive and ready to meet, each as `[slot, joins]` (a JSON list; `joins` tells a
  slot's replacement from the worker it replaces). The launcher removes a slot whose worker died before it
  respawns it; the replacement adds itself once it has built its model.
- `sync/<step>/<try>`: who meets at the sync of inner step `step`, fixed by the first member to arrive
  (an atomic compare-and-set of `members` as it stands then), so that every member of one meeting builds
  the same gloo group, under the store prefix `replicas/<step>/<try>`: one membership generation per
  meeting. A collective broken by a member dying inside it is tried again (`try + 1`) once the launcher has
  removed the dead member.

A meeting all-reduces the members' contributions with one flag per slot, saying who trained since the last
sync: the average divides by those only. A replacement (a *joiner*) contributes zeros and no flag; when a
meeting has one, the lowest member that trained broadcasts the state the joiner takes as its own (the
global weights, the outer optimizer's state), before anyone changes its own, so that a retried meeting
starts from the same contributions. `loom.parallel.local_sgd` holds what the replicas do with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from loom.dist import env, launch
from loom.dist.env import collective_timeout

__all__ = ["Meeting", "Membership", "ReplicaWorkers", "membership", "membership_slot"]

# The environment of a worker of `supervise_replicas`: its slot, the number of slots, the store's address,
# and how many times the slot's worker was replaced (0: a worker of the job's start).
RANK_VAR, SIZE_VAR, STORE_VAR, JOINS_VAR = (
    "LOOM_REPLICA_RANK",
    "LOOM_REPLICA_COUNT",
    "LOOM_REPLICA_STORE",
    "LOOM_REPLICA_JOINS",
)
MEMBERS = "members"
# How often a member waiting for the roster to change looks again, and beats while it waits.
_POLL_S = 0.05
_BEAT_EVERY_S = 1.0


@contextlib.contextmanager
def _beating(step: int) -> Iterator[None]:
    """Beat (as at the end of step `step`) every `_BEAT_EVERY_S` from a thread while the block runs: a
    member blocked in a meeting's gloo calls (building the group, the all-reduce) is waiting for the others,
    not hung, and must not be the one the launcher kills."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(_BEAT_EVERY_S):
            launch.heartbeat(step)

    thread = threading.Thread(target=beat, name="loom-replica-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def membership() -> Membership | None:
    """This worker's `Membership` when it is a worker of `supervise_replicas`, else None."""
    if RANK_VAR not in os.environ:
        return None
    return Membership(
        int(os.environ[RANK_VAR]),
        int(os.environ[SIZE_VAR]),
        os.environ[STORE_VAR],
        int(os.environ.get(JOINS_VAR, "0")),
    )


def membership_slot() -> tuple[int, int] | None:
    """(slot, workers the slot had before this one) in a worker of `supervise_replicas`, else None (read from
    the environment: no store is opened)."""
    if RANK_VAR not in os.environ:
        return None
    return int(os.environ[RANK_VAR]), int(os.environ.get(JOINS_VAR, "0"))


def open_store(address: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the launcher's store at `address` ("host:port")."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def update_members(store: dist.Store, change: Callable[[list[list[int]]], list[list[int]]]) -> None:
    """Apply `change` to the `members` roster atomically (compare-and-set until no one raced us)."""
    while True:
        old = store.get(MEMBERS) if store.check([MEMBERS]) else b"[]"
        new = json.dumps(sorted(change(json.loads(old)))).encode()
        if store.compare_set(MEMBERS, old, new) == new:
            return


@dataclass(frozen=True)
class Meeting:
    """What one sync brought: the sum of the contributions, the slots that trained (the divisor) and every
    member, and the bytes the lowest trained member shared (None when no joiner met)."""

    summed: torch.Tensor
    trained: list[int]
    members: list[int]
    shared: bytes | None


class Membership:
    """This worker's slot among the replicas, and the meetings with the others (see the module docstring).

    `joins`: how many workers held this slot before (0: the job's first). A worker with `joins > 0` is a
    replacement: it takes part in no meeting before `join_at` found it the one it joins."""

    def __init__(self, rank: int, size: int, address: str, joins: int = 0) -> None:
        self.rank, self.size, self.joins = rank, size, joins
        self.timeout = env.collective_timeout()
        self.store = open_store(address, self.timeout)

    @property
    def joining(self) -> bool:
        """True for a replacement worker (it holds no global state until its first meeting)."""
        return self.joins > 0

    @property
    def identity(self) -> list[int]:
        """This worker in the roster: `[slot, joins]`."""
        return [self.rank, self.joins]

    def members(self) -> list[list[int]]:
        """The roster as it stands: `[slot, joins]` of each worker alive and ready to meet."""
        return json.loads(self.store.get(MEMBERS))

    def _resolve(self, key: str) -> list[list[int]]:
        """Who meets at `key`: the roster when the first of them arrived (compare-and-set)."""
        return json.loads(self.store.compare_set(key, "", json.dumps(self.members())))

    def join_at(self, every: int, last_step: int) -> int | None:
        """A replacement's entry: add this slot to the roster, then find the first sync (a multiple of
        `every`, at most `last_step`) whose members include it; None when none is left to join."""
        update_members(self.store, lambda members: [*members, self.identity])
        step = every
        while step <= last_step:
            if self.identity in self._resolve(f"sync/{step}/0"):
                return step
            step += every
        return None

    def meet(
        self, step: int, flat: torch.Tensor, trained: bool, share: Callable[[], bytes] | None
    ) -> Meeting:
        """The sync of inner step `step`: sum `flat` over the members with this slot's `trained` flag, and,
        when a member did not train, bring it `share()` of the lowest member that did (nothing when `share`
        is None: the sum is all it needs). Tried again, in the next generation, without the members that
        died: before arriving (seen in the roster while the others wait for them) or inside the collective.
        Only the first try takes in replacements; a retry is the members of the one before still alive."""
        previous: list[list[int]] = []
        for attempt in range(self.size + 1):  # each retry follows one more death: at most every slot
            key = f"sync/{step}/{attempt}"
            if attempt == 0:
                resolved = self._resolve(key)
            else:
                alive = self.members()
                survivors = [m for m in previous if m in alive]
                resolved = json.loads(self.store.compare_set(key, "", json.dumps(survivors)))
            if self.identity not in resolved:
                raise RuntimeError(
                    f"replica {self.rank} is not among the members {resolved} of the sync at step {step}: "
                    "the launcher took it for dead"
                )
            previous, slots = resolved, [slot for slot, _ in resolved]
            if not self._arrive(f"replicas/{step}/{attempt}", resolved, step):
                print(
                    f"loom: replica {self.rank}: a member of {slots} left before the sync at step {step}; "
                    "meeting without it",
                    flush=True,
                )
                continue  # the next generation goes on without it
            try:
                with _beating(step - 1):
                    return self._meet_once(step, attempt, slots, flat, trained, share)
            except RuntimeError as error:  # a member died inside the collective (gloo: connection closed)
                print(
                    f"loom: replica {self.rank}: the sync at step {step} among {slots} broke "
                    f"({str(error).splitlines()[0][:120]}); retrying without the dead",
                    flush=True,
                )
                self._wait_for_change(resolved, step)
        raise RuntimeError(f"replica {self.rank}: the sync at step {step} failed {self.size + 1} times")

    def _arrive(self, prefix: str, members: list[list[int]], step: int) -> bool:
        """Wait until every member of a meeting arrived (True), or one of them left the roster before it
        did (False): a dead member is noticed here at once, not after the collective timeout. Every member
        acts on one verdict, the first one stored (a member that completes the count and one that sees a
        member gone meanwhile must not part ways: one would build the group and wait for the dead). A
        member waiting beats (as at the end of step `step - 1`): the one that does not come is the silent one."""
        verdict = f"{prefix}/verdict"
        arrived = self.store.add(f"{prefix}/arrived", 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        beaten = time.monotonic()
        while True:
            if arrived >= len(members):
                return self.store.compare_set(verdict, "", b"go") == b"go"
            alive = self.members()
            if any(m not in alive for m in members):
                return self.store.compare_set(verdict, "", b"retry") == b"go"
            if self.store.check([verdict]):  # another member decided
                return self.store.get(verdict) == b"go"
            if time.monotonic() - beaten > _BEAT_EVERY_S:
                launch.heartbeat(step - 1)
                beaten = time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the members {members} did not all arrive at {prefix} in time")
            time.sleep(_POLL_S)
            arrived = self.store.add(f"{prefix}/arrived", 0)

    def _meet_once(
        self,
        step: int,
        attempt: int,
        members: list[int],
        flat: torch.Tensor,
        trained: bool,
        share: Callable[[], bytes] | None,
    ) -> Meeting:
        group = self._group(f"replicas/{step}/{attempt}", members)
        flags = torch.zeros(self.size, dtype=flat.dtype)
        flags[self.rank] = 1.0 if trained else 0.0
        buffer = torch.cat([flat.reshape(-1), flags])  # a copy: a retry starts from `flat` as it was
        group.allreduce([buffer]).wait()
        summed, flags = buffer[: flat.numel()].view_as(flat), buffer[flat.numel() :]
        did = [r for r in members if flags[r] > 0]
        if not did:
            raise RuntimeError(f"no member of the sync at step {step} ({members}) holds the replicas' state")
        shared = None
        if share is not None and len(did) < len(
            members
        ):  # a joiner is here: the lowest member that trained shares its state
            shared = self._broadcast(group, members.index(did[0]), share() if self.rank == did[0] else None)
        return Meeting(summed, did, members, shared)

    def _group(self, prefix: str, members: list[int]) -> dist.ProcessGroupGloo:
        """The gloo group of one meeting (this membership generation), built from the launcher's store."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        store = dist.PrefixStore(prefix, self.store)
        return dist.ProcessGroupGloo(store, members.index(self.rank), len(members), options)

    @staticmethod
    def _broadcast(group: dist.ProcessGroupGloo, root: int, payload: bytes | None) -> bytes:
        """`payload` of the member at index `root` to every member (its length first)."""
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        group.broadcast(length, root).wait()
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload is not None
            else torch.empty(int(length), dtype=torch.uint8)
        )
        group.broadcast(data, root).wait()
        return data.numpy().tobytes()

    def _wait_for_change(self, members: list[list[int]], step: int) -> None:
        """Wait, beating, until the launcher took a member of a broken meeting off the roster (the one that
        died). Identities, not slots: a replacement may already hold the dead member's slot."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        with _beating(step - 1):
            while all(m in self.members() for m in members) and time.monotonic() < deadline:
                time.sleep(_POLL_S)


# ---------------------------------------------------------------------------------------------- launcher


class ReplicaWorkers:
    """The launcher's side: `nprocs` workers, each a process group of one and a slot of the job, around a
    rendezvous store hosted here. A worker that dies (or stays silent past the heartbeat timeout, and is
    killed) leaves: its slot is taken off the roster and a replacement is started in it, the others go on.
    `env` adds environment variables to the workers'."""

    def __init__(self, nprocs: int, backend: str | None = None, *, env: dict[str, str] | None = None) -> None:
        self.nprocs, self.backend, self.extra_env = nprocs, backend, dict(env or {})
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=collective_timeout()
        )
        self.store.set(MEMBERS, json.dumps([[rank, 0] for rank in range(nprocs)]))
        self.joins = dict.fromkeys(range(nprocs), 0)
        self.heartbeats: dict[int, launch.Heartbeat] = {}
        self._procs: dict[int, mp.process.BaseProcess] = {}
        self._conns: dict[int, Connection] = {}
        self._started: dict[int, bool] = {}

    def _spawn(self, rank: int) -> None:
        threads = str(launch._thread_count(self.nprocs))
        extra = {
            **self.extra_env,
            RANK_VAR: str(rank),
            SIZE_VAR: str(self.nprocs),
            STORE_VAR: f"127.0.0.1:{self.store.port}",
            JOINS_VAR: str(self.joins[rank]),
            "OMP_NUM_THREADS": threads,
        }
        with launch._spawnable_main():
            # a process group of one (rank 0 of 1, its own store on a port the OS picks)
            proc, conn = launch.start_worker(launch._context(), 0, 1, 0, self.backend, extra, rank)
        self._procs[rank], self._conns[rank], self._started[rank] = proc, conn, False
        self.heartbeats.pop(rank, None)

    def run(
        self,
        fn: Callable,
        /,
        *args: Any,
        heartbeat_timeout: float | None = None,
        on_leave: Callable[[int, int | None, str], bool],
        **kwargs: Any,
    ) -> list:
        """Run `fn(*args, **kwargs)` in every slot until each returns; the results, index = slot.

        `on_leave(rank, last_step, cause)` is called when a slot's worker dies or hangs: True starts a
        replacement, False ends the run (`WorkerDiedError`). A worker that raises ends it (`WorkerError`)."""
        payload = launch._dump_task(fn, args, kwargs)
        results: dict[int, Any] = {}
        since: dict[int, float] = {}
        for rank in range(self.nprocs):
            self._spawn(rank)
            since[rank] = time.monotonic()
        try:
            while len(results) < self.nprocs:
                running = [r for r in range(self.nprocs) if r not in results]
                handles = [self._conns[r] for r in running] + [self._procs[r].sentinel for r in running]
                wait(handles, launch._BEAT_POLL_S)
                for rank in running:
                    left = self._read(rank, payload, results, since)
                    if left is None and heartbeat_timeout is not None:
                        if time.monotonic() - since[rank] > heartbeat_timeout:
                            self._procs[rank].kill()
                            self._procs[rank].join()
                            left = f"sent no heartbeat for more than {heartbeat_timeout:g} s (killed)"
                    if left is not None:
                        beat = self.heartbeats.get(rank)
                        if not on_leave(rank, beat.step if beat is not None else None, left):
                            raise launch.WorkerDiedError(
                                f"rank {rank} {left}; no replacement allowed: every worker was stopped",
                                rank=rank,
                                exitcode=self._procs[rank].exitcode,
                            )
                        update_members(self.store, lambda members, r=rank: [m for m in members if m[0] != r])
                        self.joins[rank] += 1
                        self._spawn(rank)
                        since[rank] = time.monotonic()
            return [results[r] for r in range(self.nprocs)]
        finally:
            self.close()

    def _read(self, rank: int, payload: bytes, results: dict, since: dict) -> str | None:
        """Take what slot `rank`'s worker sent; why it left (died) when it did, else None."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            while rank not in results and conn.poll():
                kind, value = launch.WorkerGroup._decode(rank, conn.recv_bytes())
                since[rank] = time.monotonic()
                if kind == "error":
                    raise launch.WorkerError(
                        f"rank {rank} raised {value.type_name}: {value.message}\n{value.traceback}",
                        rank=rank,
                        traceback=value.traceback,
                        exc_type=value.type_name,
                        failed_ranks=[rank],
                    ) from value.original()
                if kind == "beat":
                    step, phase = value
                    self.heartbeats[rank] = launch.Heartbeat(step, time.monotonic(), phase)
                elif not self._started[rank]:  # joined its process group: give it the task
                    self._started[rank] = True
                    conn.send_bytes(payload)
                else:
                    results[rank] = value
        except (EOFError, OSError):
            pass
        if rank in results or proc.is_alive():
            return None
        proc.join()
        return launch._exit_reason(proc.exitcode)

    def close(self) -> None:
        """Stop every worker (those that returned leave their process group and exit)."""
        for conn in self._conns.values():
            try:
                conn.send_bytes(launch._STOP)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns.values():
            conn.close()
