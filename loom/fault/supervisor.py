"""Supervised runs: start the workers, watch them, and restart the whole job when one fails.

`supervise(fn, nprocs, ...)` runs `fn` on a fresh `WorkerGroup` and waits. A worker that dies (SIGKILL,
`os._exit`, a crash), raises after training began, or stays silent for longer than the heartbeat timeout ends
the attempt: every worker is stopped, the event is logged with rank, step and cause, and a new group starts,
up to `max_restarts` times. Silence counts from a rank's last heartbeat (`loom.dist.launch.heartbeat`: once
per step, and once per start-up phase such as building the model or loading a checkpoint), or from the start
of the attempt before its first. Each attempt sees its number in TORCHELASTIC_RESTART_COUNT, as under
`torchrun --max-restarts`; the job itself resumes from its last committed checkpoint (see
`loom/train/job.py`).

`supervise_replicas(fn, nprocs, ...)` is the mode for replicas that come and go (`loom.dist.elastic`, `[fault]
elastic_replicas` in `loom train`): a worker's death, or its silence past the heartbeat timeout, is an event
(`kind = "replica_left"`) after which a replacement starts in its slot and the other workers go on; no
attempt ends.

An exception raised before a rank reported its first step (a bad config, a model that does not fit the mesh)
is not retried: it would fail the same way again. Nor, at any step, is an error that a restart cannot fix
(`PERMANENT_ERRORS`: a configuration error such as ValueError or TypeError, a filesystem layout error such
as NotADirectoryError or FileExistsError, a PermissionError): it is logged and recorded, then re-raised.
Writing the events file never stops the supervisor: if it cannot be written, the event is only logged. A hang before the first step is restarted like any other:
its usual causes (a stalled file system, a peer that never arrived, a deadlock that depends on timing) pass,
and one that does not spends the restart budget, which bounds it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loom.dist.elastic import ReplicaWorkers
from loom.dist.launch import LaunchError, WorkerDiedError, WorkerError, WorkerGroup, WorkerHangError

__all__ = [
    "PERMANENT_ERRORS",
    "FailureEvent",
    "RestartBudgetExceeded",
    "RestartPolicy",
    "supervise",
    "supervise_replicas",
]

# Exceptions that ask for a restart on purpose (the non-finite guard's rollback): retried at any time.
_RESTART_REQUESTS = ("loom.fault.guard.NonFiniteRollback",)

# Errors that a restart cannot fix: the same settings and the same files give the same error again.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # a setting out of range, a config that does not fit the mesh (loom's user errors)
    TypeError,
    NotImplementedError,
    ImportError,
    PermissionError,
    NotADirectoryError,  # a file where a directory should be (checkpoint.dir naming a file)
    IsADirectoryError,
    FileExistsError,
)


@dataclass(kw_only=True)
class RestartPolicy:
    """How a supervised job reacts to failures.

    `max_restarts`: restarts allowed after the first attempt (0: fail at the first failure).
    `heartbeat_timeout_s`: how long a rank may stay silent, between heartbeats (steps and start-up phases) or
    from the start of an attempt to its first (None: never a hang).
    `collective_timeout_s`: the process group's timeout for one collective (None: torch's 30 minutes).
    `events_file`: a JSON-lines file every failure event is appended to (None: only logged).
    """

    max_restarts: int = 3
    heartbeat_timeout_s: float | None = 300.0
    collective_timeout_s: float | None = None
    events_file: str | Path | None = None

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts {self.max_restarts} must be >= 0")
        for name in ("heartbeat_timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value} must be > 0 (or None: no limit)")


@dataclass(frozen=True)
class FailureEvent:
    """One failed attempt, or a replica that left (`kind`: died, hung, raised, rollback, replica_left), on
    which ranks, at which step (the last one the rank reported; None before its first: while starting up),
    and the cause in a line."""

    attempt: int
    kind: str
    ranks: tuple[int, ...]
    step: int | None
    cause: str
    time: float = field(default_factory=time.time)

    def describe(self) -> str:
        where = "before its first step" if self.step is None else f"after step {self.step}"
        who = ("rank " if len(self.ranks) == 1 else "ranks ") + ", ".join(map(str, self.ranks))
        return f"attempt {self.attempt}: {who} {self.kind} {where}: {self.cause}"


class RestartBudgetExceeded(LaunchError):
    """The job failed more often than its restart budget allows; `.events` lists every failure."""

    def __init__(self, message: str, events: list[FailureEvent]) -> None:
        super().__init__(message)
        self.events = events


@dataclass
class Supervised:
    """What a supervised run returns: each rank's result of the final attempt, and every failure before."""

    results: list[Any]
    events: list[FailureEvent]


def supervise(
    fn: Callable,
    nprocs: int,
    /,
    *args: Any,
    policy: RestartPolicy | None = None,
    log: Callable[[str], None] = print,
    backend: str | None = None,
    **kwargs: Any,
) -> Supervised:
    """Run `fn(*args, **kwargs)` on `nprocs` local workers, restarting all of them after a failure (see the
    module docstring); `backend`: their process group's (None: NCCL with a GPU per rank, else gloo). Raises `RestartBudgetExceeded` when the budget is spent, and re-raises at once an
    error that a restart would not cure."""
    policy = policy or RestartPolicy()
    events: list[FailureEvent] = []
    for attempt in range(policy.max_restarts + 1):
        group = WorkerGroup(nprocs, backend=backend, env=_attempt_env(attempt, policy))
        try:
            with group:
                results = group.run(fn, *args, heartbeat_timeout=policy.heartbeat_timeout_s, **kwargs)
            return Supervised(results, events)
        except LaunchError as error:
            event = _event(attempt, error, group)
            if event is None:
                raise
            if _permanent(error):
                _record(event, policy, log, then="not retried: a restart cannot fix this error")
                raise
            events.append(event)
            _record(event, policy, log)
    raise RestartBudgetExceeded(
        f"the job failed {len(events)} times, more than its {policy.max_restarts} restart(s) allow; last: "
        f"{events[-1].describe()}",
        events,
    )


def supervise_replicas(
    fn: Callable,
    nprocs: int,
    /,
    *args: Any,
    policy: RestartPolicy | None = None,
    log: Callable[[str], None] = print,
    backend: str | None = None,
    **kwargs: Any,
) -> Supervised:
    """Run `fn` on `nprocs` replicas that come and go (`loom.dist.elastic`): a worker that dies, or stays
    silent past the heartbeat timeout (and is killed), is an event (`kind = "replica_left"`, its rank and
    last step), logged and recorded like a failure, and a replacement starts in its slot while the others go
    on; `policy.max_restarts` bounds the replacements. A worker that raises ends the job (`WorkerError`).
    `backend`: each replica's process group's (as `supervise`'s)."""
    policy = policy or RestartPolicy()
    events: list[FailureEvent] = []

    def on_leave(rank: int, step: int | None, cause: str) -> bool:
        event = FailureEvent(0, "replica_left", (rank,), step, cause)
        left = policy.max_restarts - len(events)
        events.append(event)
        then = "a replacement joins at the next sync" if left > 0 else "no replacements left"
        _record(event, policy, log, then=then)
        return left > 0

    workers = ReplicaWorkers(nprocs, backend, env=_attempt_env(0, policy))
    results = workers.run(
        fn, *args, heartbeat_timeout=policy.heartbeat_timeout_s, on_leave=on_leave, **kwargs
    )
    return Supervised(results, events)


def _attempt_env(attempt: int, policy: RestartPolicy) -> dict[str, str]:
    env = {"TORCHELASTIC_RESTART_COUNT": str(attempt)}
    if policy.collective_timeout_s is not None:
        env["LOOM_COLLECTIVE_TIMEOUT_S"] = str(policy.collective_timeout_s)
    return env


def _event(attempt: int, error: LaunchError, group: WorkerGroup) -> FailureEvent | None:
    """The failure as an event, or None when restarting cannot help."""
    beats = group.heartbeats
    if isinstance(error, WorkerHangError):
        steps = list(error.last_steps.values())
        step = None if not steps or None in steps else min(steps)  # a rank still starting up is the lowest
        return FailureEvent(attempt, "hung", tuple(error.ranks), step, _first_line(str(error)))
    if isinstance(error, WorkerDiedError):
        step = beats[error.rank].step if error.rank in beats else None
        return FailureEvent(attempt, "died", (error.rank,), step, _first_line(str(error)))
    if isinstance(error, WorkerError):
        step = beats[error.rank].step if error.rank in beats else None
        requested = error.exc_type in _RESTART_REQUESTS
        if step is None and not requested:
            return None  # failed while setting up: the same error would come back
        kind = "rollback" if requested else "raised"
        return FailureEvent(attempt, kind, tuple(error.failed_ranks), step, _first_line(str(error)))
    return None  # a timeout of the whole task, or a group that never started: not a worker's fault


def _permanent(error: LaunchError) -> bool:
    """Whether a worker's exception is one that a restart cannot fix (`PERMANENT_ERRORS`), judged by the
    worker's exception object when it survived the trip, else by its type's name."""
    if not isinstance(error, WorkerError) or error.exc_type in _RESTART_REQUESTS:
        return False
    original = error.__cause__
    if original is not None:
        return isinstance(original, PERMANENT_ERRORS)
    return error.exc_type in {cls.__qualname__ for cls in PERMANENT_ERRORS}


def _record(
    event: FailureEvent, policy: RestartPolicy, log: Callable[[str], None], then: str | None = None
) -> None:
    left = policy.max_restarts - event.attempt
    if then is None:
        then = f"restarting ({left} restart(s) left)" if left > 0 else "no restarts left"
    log(f"loom: {event.describe()}; {then}")
    if policy.events_file is not None:
        path = Path(policy.events_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as file:
                file.write(json.dumps(asdict(event)) + "\n")
        except OSError as error:  # the job's own problem may be this very directory: never crash on it
            log(
                f"loom: could not append the event to {str(path)!r} ({type(error).__name__}: {error}); logged only"
            )


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
