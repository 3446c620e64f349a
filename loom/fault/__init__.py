"""Failure detection and recovery: supervised restarts, hang detection, the non-finite guard, and faults
injected on purpose to test them (see supervisor.py, guard.py, inject.py)."""

from loom.fault.guard import NonFiniteGuard, NonFiniteRollback, apply_rollback
from loom.fault.inject import Fault, InjectedFault
from loom.fault.supervisor import (
    FailureEvent,
    RestartBudgetExceeded,
    RestartPolicy,
    Supervised,
    supervise,
    supervise_replicas,
)

__all__ = [
    "FailureEvent",
    "Fault",
    "InjectedFault",
    "NonFiniteGuard",
    "NonFiniteRollback",
    "RestartBudgetExceeded",
    "RestartPolicy",
    "Supervised",
    "apply_rollback",
    "supervise",
    "supervise_replicas",
]
