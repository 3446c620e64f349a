"""One background thread per process for what a save leaves off the training thread: background writes and
pruning old checkpoints. Jobs run one at a time, in the order submitted, so a prune never races a write
into the same root, and two background writes never share the checkpoint process group."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_executor: ThreadPoolExecutor | None = None
_last: Future | None = None


def submit(fn: Callable[..., Any], *args: Any) -> Future:
    """Run `fn(*args)` on the checkpoint thread, after every job submitted before; its future."""
    global _executor, _last
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-checkpoint")
    _last = _executor.submit(fn, *args)
    return _last


def settle() -> None:
    """Wait until every job submitted so far has ended (whatever its outcome: the job's owner reads it)."""
    if _last is not None:
        futures.wait([_last])
