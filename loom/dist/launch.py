"""Run a function on N local worker processes, each one rank of an initialised process group.

`WorkerGroup` keeps its workers alive between tasks (the test pool and `loom run` build on it); `launch`
is a group used once. Workers set torchrun's environment variables and join the group through
`env.ensure_process_group`, so user code that calls it again (or reads RANK, WORLD_SIZE, LOCAL_RANK) sees
what it would see under torchrun.

Workers are started by multiprocessing's "spawn" (each imports torch itself: about 1.5 s of CPU per
worker). `LOOM_START_METHOD=forkserver` (Linux, macOS) forks them instead from a server process, started
once per caller, that imported torch and loom's launcher (and the modules named in
`LOOM_FORKSERVER_PRELOAD`, e.g. `loom.train.job` for training jobs): a group of 4 then starts in a tenth of
a second, and so does a restart after a failure. It is not the default yet: in seven runs of the test suite with it, one worker of
a long-lived group died once of SIGSEGV, not reproduced since (workers now print their Python stacks on a
native crash). A forked worker takes the caller's environment, directory and output as they are when it
starts (not the server's) and, as with "spawn", imports the caller's script as `__mp_main__`; settings that
torch reads once in a process (ATEN_CPU_CAPABILITY) are the server's, so set them before the first launch.

Failures are reported as `LaunchError` subclasses and never leave a worker behind: a worker that raises
(`WorkerError`), dies (`WorkerDiedError`, noticed at once through the process sentinels) or does not
answer in time (`WorkerTimeoutError`). After a death, a timeout, or an error that leaves peers stuck, the
group is torn down and marked broken.

What reaches the workers: the task is pickled with cloudpickle. Functions and classes of an importable
module, and those at the top level of the caller's script (which every worker imports, as multiprocessing's
"spawn" does), go by reference; the rest of the caller's `__main__` goes by value: functions typed into a
REPL, a notebook, `python -c` or `python - < script`, defined under `if __name__ == "__main__":`, lambdas
and nested functions (as Accelerate's `notebook_launcher` allows). A script whose top level calls `launch`
without that guard would start workers again in every worker: each worker stops at once and the caller
raises one `LaunchError` that names the line to guard.

`launch` seeds torch, Python's `random` and NumPy alike on every rank before the task (`seed=0`), so that
"plain tensors are the same on every rank" holds for random ones too; `seed=None` leaves each worker's
generators as the process started them (different on every rank).

Heartbeats: a task calls `heartbeat(step)` once per training step and `heartbeat(phase=...)` as it enters
each start-up phase (building the model, loading a checkpoint); outside a loom worker both are no-ops. With
`heartbeat_timeout`, a rank that stays silent longer than that is taken for hung (`WorkerHangError`) and the
group is torn down; the clock of a rank that has not beaten yet starts when it receives the task, so a rank
that hangs before its first step is caught too, while a slow start-up that keeps beating is not. The last
beat of every rank stays readable in `WorkerGroup.heartbeats`.
"""

from __future__ import annotations

import ast
import atexit
import faulthandler
import functools
import inspect
import io
import linecache
import math
import multiprocessing as mp
import numbers
import os
import pickle
import signal
import sys
import threading
import time
import tokenize
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from loom.dist import env, rng

__all__ = [
    "LaunchError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerHangError",
    "WorkerTimeoutError",
    "heartbeat",
    "launch",
]

# How long the other ranks may take to finish after one rank raised before the group counts as stuck.
_ERROR_GRACE_S = 3.0
# Seconds for workers to leave the process group and exit on close() before they are killed.
_CLOSE_TIMEOUT_S = 30.0
# Start attempts when the rendezvous port was taken between picking it and rank 0 binding it.
_START_ATTEMPTS = 3
# An empty message tells a worker to shut down; a pickled task is never empty.
_STOP = b""
# How often the caller wakes to check heartbeats while it waits for answers.
_BEAT_POLL_S = 0.5
# The exit status of a worker that found the caller's script calling `launch` at its top level while the
# worker imported it (no `if __name__ == "__main__":` guard); the caller turns it into one clear error.
_UNGUARDED_MAIN_EXIT = 76
# What a worker process is named: the prefix tells loom's workers from other processes.
_WORKER_NAME = "loom-rank"


class LaunchError(RuntimeError):
    """Base class of every error that `launch` and `WorkerGroup` raise."""


class WorkerError(LaunchError):
    """A worker raised: `.rank` is the lowest failing rank, `.traceback` its formatted traceback."""

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        traceback: str = "",
        exc_type: str = "",
        failed_ranks: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exc_type = exc_type
        self.failed_ranks: list[int] = list(failed_ranks)


class WorkerDiedError(LaunchError):
    """A worker process ended without answering (a signal, `os._exit`, a crash)."""

    def __init__(self, message: str, *, rank: int = -1, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class WorkerTimeoutError(LaunchError):
    """Some workers did not answer within the task's timeout; `.ranks` lists them."""

    def __init__(self, message: str, *, ranks: Iterable[int] = (), timeout: float | None = None) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks)
        self.timeout = timeout


class WorkerHangError(WorkerTimeoutError):
    """Ranks went silent for longer than the heartbeat timeout; `.ranks` lists them, `.last_steps` maps each
    rank to the step of its last heartbeat (None: it had not reported a step yet, it hung starting up)."""

    def __init__(
        self, message: str, *, ranks: Iterable[int] = (), timeout: float | None = None, last_steps=None
    ) -> None:
        super().__init__(message, ranks=ranks, timeout=timeout)
        self.last_steps: dict[int, int | None] = dict(last_steps or {})


@dataclass(frozen=True)
class Heartbeat:
    """A rank's sign of life: the step it reported (None during start-up) or the start-up `phase` it
    entered, and when the caller received it (monotonic seconds)."""

    step: int | None
    received: float
    phase: str | None = None

    def describe(self) -> str:
        """ "step 3", or "start-up phase 'loading the checkpoint'"."""
        return f"step {self.step}" if self.step is not None else f"start-up phase {self.phase!r}"


@dataclass
class _Failure:
    """An exception raised in a worker, in a form that always pickles."""

    type_name: str
    message: str
    traceback: str
    exception: bytes | None = None  # the pickled exception, when it pickles

    def original(self) -> BaseException | None:
        """The worker's exception object, when it survives the trip; None otherwise."""
        if self.exception is None:
            return None
        try:
            return pickle.loads(self.exception)
        except Exception:
            return None


def _type_name(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    # A class from the caller's script lives in "__mp_main__" inside a spawned worker.
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{_type_name(exc)} whose str() failed>"


def _failure(exc: BaseException, note: str = "", skip_frames: int = 0) -> _Failure:
    """Describe `exc`; `skip_frames` drops loom's own outermost frames from the traceback."""
    try:
        blob = pickle.dumps(exc)
    except Exception:
        blob = None
    tb = exc.__traceback__
    for _ in range(skip_frames):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return _Failure(_type_name(exc), note or _safe_str(exc), text, blob)


def _first_line(text: str, limit: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- pickling


def _main_module() -> types.ModuleType | None:
    return sys.modules.get("__main__")


def _main_source() -> str | None:
    """The file of the caller's `__main__` that every spawned worker imports, or None when it imports none
    (a REPL, a notebook, `python -c`, `python - < script`)."""
    main = _main_module()
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):  # `python -m package.module`
        if spec.name == "__main__" or spec.name.endswith(".__main__"):
            return None  # `python -m package`, a directory or a zip: multiprocessing imports none of it
        origin = getattr(spec, "origin", None)
        return origin if origin and os.path.isfile(origin) else None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str):
        return None
    if not os.path.isabs(path) and mp.process.ORIGINAL_DIR is not None:
        path = os.path.join(mp.process.ORIGINAL_DIR, path)
    return path if os.path.isfile(path) else None


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round, or any test that reads `__name__`)."""
    return isinstance(node, ast.If) and any(
        isinstance(sub, ast.Name) and sub.id == "__name__" for sub in ast.walk(node.test)
    )


def _bound_names(nodes: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(sub.name)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names.add(sub.id)
            elif isinstance(sub, ast.alias):
                names.add((sub.asname or sub.name).split(".")[0])
    return names


@functools.lru_cache(maxsize=8)
def _guarded_names(path: str, mtime: float) -> frozenset[str]:
    """Names the script at `path` binds only under its `if __name__ == "__main__":` blocks: a worker that
    imports the script never defines them."""
    try:
        tree = ast.parse(open(path, "rb").read(), path)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    guarded = [node for node in tree.body if _is_main_guard(node)]
    inside = _bound_names([stmt for node in guarded for stmt in node.body + node.orelse])
    outside = _bound_names([node for node in tree.body if not _is_main_guard(node)])
    return frozenset(inside - outside)


def _workers_import(obj: object) -> bool:
    """True when a spawned worker finds `obj`, a function or class of the caller's `__main__`, by name: it is
    defined at the top level of the script that the worker imports, outside the main guard."""
    qualname = getattr(obj, "__qualname__", "")
    if "<" in qualname:  # a lambda, or a function or class nested in a function
        return False
    path = _main_source()
    if path is None:
        return False
    head = qualname.split(".")[0]
    if getattr(_main_module(), head, None) is None:
        return False
    if qualname == head and getattr(_main_module(), head) is not obj:
        return False  # redefined since, or made by value in this worker: not the module's object
    return head not in _guarded_names(path, os.path.getmtime(path))


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, except that the caller's `__main__` functions and classes that every worker imports
    (top level of the script, outside the guard) go by reference, as plain pickle sends them: so that in
    the worker they are the script's own objects (what `torch.save` and other pickles there expect)."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, type | types.FunctionType)
            and getattr(obj, "__module__", None) == "__main__"
            and _workers_import(obj)
        ):
            return NotImplemented  # pickle's own by-reference path
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------- worker


def _send(conn: Connection, kind: str, value: Any) -> None:
    """Send (kind, value) pickled; a value that does not pickle becomes an error the caller can read."""
    try:
        data = _dumps((kind, value))
    except Exception as exc:
        note = (
            f"the worker could not pickle its {'return value' if kind == 'ok' else kind} "
            f"({_type_name(value)}) to send it to the caller: {_safe_str(exc)}; return plain data "
            "(tensors, numbers, strings, lists, dicts) instead"
        )
        data = pickle.dumps(("error", _failure(exc, note)))
    conn.send_bytes(data)


# The worker's end of its pipe to the caller, while it serves tasks (None elsewhere).
_CALLER: Connection | None = None

# Called in the worker as `hook(step, phase)` after each heartbeat (also outside a loom worker): where
# fault-injection tests stop a rank in a start-up phase (see loom/fault/inject.py).
BEAT_HOOKS: list[Callable[[int | None, str | None], None]] = []


def heartbeat(step: int | None = None, *, phase: str | None = None) -> None:
    """Tell the caller this worker is alive: at training step `step`, or entering start-up phase `phase`
    (e.g. "loading the checkpoint"); a no-op outside a `WorkerGroup` worker. Training loops beat once per
    step and start-up code once per phase, so that the caller's `heartbeat_timeout` bounds every silence:
    each phase, like each step, must take less than that timeout."""
    if (step is None) == (phase is None):
        raise ValueError(f"heartbeat takes a step or a start-up phase, got step={step!r}, phase={phase!r}")
    step = None if step is None else int(step)
    if _CALLER is not None:
        _CALLER.send_bytes(pickle.dumps(("beat", (step, phase))))
    for hook in BEAT_HOOKS:
        hook(step, phase)


def _exit_with_parent() -> None:
    """Exit as soon as the parent process is gone, so an orphaned worker never lingers."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="loom-parent-watch", daemon=True).start()


def _set_worker_env(rank: int, nprocs: int, port: int, extra: dict[str, str]) -> None:
    os.environ.update(
        extra,
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Inherited from a parent run by torchrun, this would make rank 0 wait for a store nobody hosts.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _run_task(payload: bytes) -> tuple[str, Any]:
    try:
        fn, args, kwargs, seed = pickle.loads(payload)
        if seed is not None:
            rng.seed(seed)
        return "ok", fn(*args, **kwargs)
    except SystemExit as exc:  # a task must never end the worker silently
        if exc.code is None or exc.code == 0:
            return "ok", None  # sys.exit() and sys.exit(0) end the function successfully
        return "error", _failure(exc, f"sys.exit({exc.code!r})", skip_frames=1)
    except BaseException as exc:
        return "error", _failure(exc, skip_frames=1)


def _serve(conn: Connection) -> None:
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        if payload == _STOP:
            return
        kind, value = _run_task(payload)
        # Flush before answering, so the task's output is out before the caller moves on.
        sys.stdout.flush()
        sys.stderr.flush()
        _send(conn, kind, value)


def _worker_main(
    rank: int,
    nprocs: int,
    port: int,
    backend: str | None,
    extra_env: dict[str, str],
    caller_env: dict[str, str],
    caller_streams: tuple[Any, ...],
    conn: Connection,
) -> None:
    """Entry point of a worker process: join the process group, then serve tasks until told to stop."""
    # A forkserver's child starts with the server's environment and output: take the caller's, as a
    # "spawn"ed worker has them (its stdout and stderr where the caller's point now: a file, a capture).
    os.environ.clear()
    os.environ.update(caller_env)
    for target, stream in zip((1, 2), caller_streams, strict=True):
        if stream is not None:
            fd = stream.detach()
            if fd != target:  # a forkserver's child received a copy: put it in place, keep no other
                os.dup2(fd, target)
                os.close(fd)
    _reseed_numpy_if_inherited()
    # Ctrl-C reaches every process of the terminal; the parent owns it and tears the group down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A crash in native code (SIGSEGV, SIGBUS, SIGABRT) prints every thread's Python stack to stderr first,
    # so that the caller's "killed by signal" points at the line that crashed.
    faulthandler.enable(all_threads=True)
    # Whole lines, promptly: ranks share the terminal, and a killed worker loses no buffered output.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    _exit_with_parent()
    _set_worker_env(rank, nprocs, port, extra_env)
    # Ranks share the machine's cores; without this 8 ranks on 2 cores oversubscribe badly. A thread count
    # the user set (OMP_NUM_THREADS, as torchrun sets it) is kept (set here: a forkserver's child did not
    # import torch under it).
    torch.set_num_threads(_thread_count(nprocs))
    try:
        env.ensure_process_group(backend)
    except BaseException as exc:
        _send(conn, "error", _failure(exc))
        return
    _send(conn, "ok", os.getpid())
    global _CALLER
    _CALLER = conn
    try:
        _serve(conn)
    finally:
        env.shutdown_process_group()
    _leave()


class _CallerFd:
    """One of the caller's file descriptors, for a worker as it starts: pickled while multiprocessing starts
    the process, it becomes multiprocessing's own handle on a copy of it in the worker (`.detach()` gives
    its number there), the way the start methods pass a worker's pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _passed_fd, (reduction.DupFd(self.fd),)


def _passed_fd(handle: Any) -> Any:
    return handle


def _caller_streams() -> tuple[_CallerFd | None, ...]:
    """The caller's stdout and stderr file descriptors (None for one that is not open)."""
    streams = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            streams.append(None)
        else:
            streams.append(_CallerFd(fd))
    return tuple(streams)


def _reseed_numpy_if_inherited() -> None:
    """A forkserver's children inherit its NumPy global generator (Python's `random` reseeds itself at a
    fork, NumPy's does not): draw fresh entropy, as a "spawn"ed worker starts with (`launch`'s seed, when
    given, reseeds everything after this)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(int.from_bytes(os.urandom(4), "little"))


def _thread_count(nprocs: int) -> int:
    """OMP_NUM_THREADS when the user set it to a positive count, else the cores this process may use
    (its affinity mask) shared among the ranks."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // nprocs)


def _context() -> Any:
    """The multiprocessing context workers start from: "spawn", or with `LOOM_START_METHOD=forkserver` a
    forkserver preloaded with torch and loom (see the module docstring)."""
    method = os.environ.get("LOOM_START_METHOD", "").strip() or "spawn"
    if method not in ("forkserver", "spawn"):
        raise ValueError(
            f"LOOM_START_METHOD={method!r}: use 'forkserver' (workers forked from a server that imported "
            "torch once) or 'spawn' (each worker starts from scratch), or leave it unset"
        )
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(forkserver_preload())  # used when the server starts
    return ctx


def forkserver_preload() -> list[str]:
    """The modules a forkserver imports before it forks workers: torch and this launcher, then those listed
    in `LOOM_FORKSERVER_PRELOAD` (comma-separated, e.g. `loom.train.job`: what every worker of a training
    job imports, about 1.5 s of CPU each, then paid once by the server instead)."""
    extra = os.environ.get("LOOM_FORKSERVER_PRELOAD", "")
    return ["torch", "loom.dist.launch", *(name.strip() for name in extra.split(",") if name.strip())]


def _leave() -> None:
    """End a worker that has left its process group: atexit handlers, flushed streams, then `os._exit`.

    Skipping interpreter finalization saves seconds per worker (tearing torch down is slow), and with it
    the C++ static destructors, which is where gloo's abort at exit ("terminate called without an active
    exception") happens.
    """
    atexit._run_exitfuncs()  # what a normal exit would run: user handlers, logging, multiprocessing
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- caller


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe without an exit code"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with exit code {exitcode}"


def _death_hint(exitcode: int | None) -> str:
    if exitcode == -signal.SIGKILL:
        return "Check the worker's output above: SIGKILL often means the OS ran out of memory"
    if exitcode is not None and exitcode < 0:
        return "Check the worker's output above: SIGSEGV, SIGBUS or SIGABRT mean a crash in native code"
    return (
        "Check the worker's output above for why it exited (the process ended without raising through "
        "loom: os._exit, or an error while it started)"
    )


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _check_nprocs(nprocs: object, where: str = "loom.launch") -> int:
    example = f"{where}(fn, 4)" if where == "loom.launch" else f"{where}(4)"
    if isinstance(nprocs, bool) or not isinstance(nprocs, numbers.Integral):
        hint = " (the call is loom.launch(fn, nprocs, *args): fn first)" if callable(nprocs) else ""
        raise TypeError(
            f"{where}: nprocs must be a positive int, the number of worker processes; got {nprocs!r} "
            f"({type(nprocs).__name__}){hint}. E.g. {example}"
        )
    if nprocs < 1:
        raise ValueError(
            f"{where}: nprocs must be a positive int, the number of worker processes; got {nprocs}. "
            f"E.g. {example} for 4 ranks (1 runs fn in one worker)"
        )
    return int(nprocs)


def _check_backend(backend: object, nprocs: int) -> None:
    """`backend` must name a torch.distributed backend this torch build has (nccl: a GPU per rank)."""
    if backend is None:
        return
    if not isinstance(backend, str) or not backend:
        raise TypeError(
            f"loom.launch: backend must be a string such as 'gloo' or 'nccl', or None (nccl with a GPU per "
            f"rank, else gloo); got {backend!r}"
        )
    # "gloo", "nccl", or per-device "cpu:gloo,cuda:nccl"
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    for name in names:
        if name not in dist.Backend.backend_list or name in ("undefined", "fake"):
            known = ", ".join(repr(b) for b in dist.Backend.backend_list if b not in ("undefined", "fake"))
            raise ValueError(
                f"loom.launch: unknown backend {backend!r}; torch.distributed knows {known}. Use 'gloo' "
                "on CPUs, 'nccl' with one GPU per rank, or None to choose"
            )
        if not dist.is_backend_available(name):
            raise ValueError(
                f"loom.launch: backend {name!r} is not available in this torch build ({torch.__version__}); "
                "use 'gloo' on CPUs, or None to choose"
            )
    if "nccl" in names and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"loom.launch: backend {backend!r} needs one GPU per rank: nprocs={nprocs} but torch sees "
            f"{torch.cuda.device_count()} GPU(s); use backend='gloo' (CPU), fewer ranks, or None (nccl "
            "when every rank has a GPU, else gloo)"
        )


def _check_timeout(timeout: object, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout):
        raise TypeError(
            f"loom.launch: {name} must be a number of seconds, or None for no limit; got {timeout!r} "
            f"({type(timeout).__name__})"
        )
    if timeout <= 0:
        raise ValueError(
            f"loom.launch: {name} must be a positive number of seconds, or None for no limit; got {timeout!r}"
        )


def _check_call(fn: object, args: tuple, kwargs: dict) -> None:
    """`fn` is callable and takes `*args, **kwargs`: checked here, not in every worker."""
    if not callable(fn):
        raise TypeError(
            f"loom.launch: fn must be a callable that every worker calls, got {fn!r} "
            f"({type(fn).__name__}); the call is loom.launch(fn, nprocs, *args, **kwargs), e.g. "
            "loom.launch(main, 4)"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the workers will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        own = [
            name
            for name in ("backend", "timeout", "seed")
            if name in signature.parameters and name not in kwargs
        ]
        hint = (
            f"; loom.launch keeps {', '.join(f'{n}=' for n in own)} for itself: pass fn's own "
            f"{own[0]} positionally, or bind it with functools.partial(fn, {own[0]}=...)"
            if own
            else ""
        )
        raise TypeError(
            f"loom.launch: {_describe(fn)}{signature} cannot be called with the arguments given "
            f"(args={args!r}, kwargs={kwargs!r}): {exc}. Every worker calls fn(*args, **kwargs) with the "
            f"arguments that follow nprocs{hint}"
        ) from None


def _in_spawn_bootstrap() -> bool:
    """True in a process that multiprocessing's "spawn" started and that is still importing the parent's
    `__main__` (what multiprocessing itself checks before refusing to start a process)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _without_comment(line: str) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, SyntaxError):
        return line
    comment = next((tok for tok in tokens if tok.type == tokenize.COMMENT), None)
    return line[: comment.start[1]].rstrip() if comment else line


def _main_call_site() -> str:
    """Where the caller's script calls into loom, as "path, line N (`code`)" (the script alone when the
    call is not found on the stack)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            path, line = frame.f_code.co_filename, frame.f_lineno
            code = _without_comment(linecache.getline(path, line).strip())
            return f"{path}, line {line}" + (f" (`{code}`)" if code else "")
        frame = frame.f_back
    return _main_source() or "the caller's script"


def _unguarded_main_error() -> LaunchError:
    site = _main_call_site()
    code = site.split("(`", 1)[1][:-2] if "(`" in site else "results = loom.launch(main, 4)"
    return LaunchError(
        f"{site} calls loom.launch at the top level of the script, without an "
        '`if __name__ == "__main__":` guard. Every worker starts by importing the caller\'s script '
        '(multiprocessing\'s "spawn" start method), where that call would start workers again; so each '
        "worker stopped, and no task ran. Put the call under the guard:\n\n"
        f'    if __name__ == "__main__":\n        {code}\n'
    )


def _refuse_while_bootstrapping() -> None:
    """Called by `launch` and `WorkerGroup`: in a worker that is importing the caller's script, a call is
    the script's unguarded top-level `launch`. A loom worker exits at once with a status that its caller
    explains (one message, not one traceback per rank); any other spawned process raises the explanation."""
    if not _in_spawn_bootstrap():
        return
    if mp.current_process().name.startswith(_WORKER_NAME):
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(_UNGUARDED_MAIN_EXIT)
    raise _unguarded_main_error()


def start_worker(
    ctx: Any, rank: int, nprocs: int, port: int, backend: str | None, extra_env: dict[str, str], name: int
) -> tuple[mp.process.BaseProcess, Connection]:
    """Start one worker, rank `rank` of `nprocs` meeting on `port` (called under `_spawnable_main`), named
    after worker `name`: its process and the caller's end of its pipe."""
    ours, theirs = ctx.Pipe()
    args = (rank, nprocs, port, backend, extra_env, dict(os.environ), _caller_streams(), theirs)
    proc = ctx.Process(target=_worker_main, args=args, name=f"{_WORKER_NAME}{name}")
    proc.start()
    theirs.close()  # only the worker holds its end, so its death reads as EOF here
    return proc, ours


@contextmanager
def _spawnable_main() -> Iterator[None]:
    """While workers are spawned, hide a `__main__.__file__` that names no file (`python - < script`
    sets "<stdin>"): spawn would have each worker run that path and fail with FileNotFoundError. Functions
    from such a `__main__` reach the workers by value."""
    main = _main_module()
    path = getattr(main, "__file__", None)
    if main is None or getattr(main, "__spec__", None) is not None or path is None or _main_source():
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _port_was_taken(error: WorkerError) -> bool:
    text = str(error).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _last_heard(beat: Heartbeat | None) -> str:
    if beat is None:
        return "at the start of the task (no heartbeat yet)"
    return f"after step {beat.step}" if beat.step is not None else f"in {beat.describe()}"


def _dump_task(fn: Callable, args: tuple, kwargs: dict, seed: int | None = None) -> bytes:
    try:
        return _dumps((fn, args, kwargs, seed))
    except Exception as exc:
        raise TypeError(
            f"cannot send {_describe(fn)} and its arguments to the workers: {_safe_str(exc)}. Workers "
            "receive them pickled (cloudpickle): pass arguments that pickle (tensors, numbers, strings, "
            "lists, dicts, plain objects) and create the rest (locks, open files, sockets, process "
            "groups) inside the function"
        ) from exc


def _worker_error(errors: dict[int, _Failure], missing: list[int], task: str, grace: float) -> WorkerError:
    rank = min(errors)
    first = errors[rank]
    if first.type_name == "SystemExit":
        lines = [
            f"rank {rank} called {first.message} while {task}; a worker function reports through its "
            "result: return a value (sys.exit() and sys.exit(0) count as returning None), or raise an "
            "exception to report a failure"
        ]
    else:
        lines = [f"rank {rank} raised {first.type_name} while {task}: {first.message}"]
    others = [r for r in sorted(errors) if r != rank]
    if others:
        also = ", ".join(
            f"rank {r} ({errors[r].type_name}: {_first_line(errors[r].message)})" for r in others
        )
        lines.append(f"also raised: {also}")
    if missing:
        lines.append(
            f"{_ranks(missing)} had not answered {grace:g} s later (probably waiting for the failing "
            "rank, e.g. in a collective it never joined), so the worker group was shut down"
        )
    lines.append(f"traceback from rank {rank}:\n{first.traceback.rstrip()}")
    return WorkerError(
        "\n".join(lines),
        rank=rank,
        traceback=first.traceback,
        exc_type=first.type_name,
        failed_ranks=sorted(errors),
    )


class WorkerGroup:
    """`nprocs` local worker processes, each a rank of one process group, that run tasks on request.

    The workers start (and join the process group) in the constructor and stay alive between `run`
    calls. Use it as a context manager or call `close()`; an interpreter exit closes it too. `env` adds
    environment variables to the workers' (e.g. TORCHELASTIC_RESTART_COUNT for a restarted job).
    """

    def __init__(
        self,
        nprocs: int,
        backend: str | None = None,
        *,
        start_timeout: float | None = 300.0,
        error_grace: float = _ERROR_GRACE_S,
        env: dict[str, str] | None = None,
    ) -> None:
        _refuse_while_bootstrapping()
        self.nprocs = _check_nprocs(nprocs, "WorkerGroup")
        self.backend = backend
        self.error_grace = error_grace
        self.start_timeout = start_timeout
        self.extra_env = dict(env or {})
        self.heartbeats: dict[int, Heartbeat] = {}  # each rank's latest, kept after a failure
        self._task_started = 0.0  # when the current task was sent: the clock of ranks that have not beaten
        self.pids: list[int] = []
        self._problem: str | None = None  # why this group can no longer run tasks
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._start()
                return
            except WorkerError as exc:
                # The port was free when picked, but another process may take it before rank 0 binds it.
                if attempt == _START_ATTEMPTS or not _port_was_taken(exc):
                    raise

    def _start(self) -> None:
        """Spawn the workers and wait until each has joined the process group; on failure stop them all."""
        self._problem, self._procs, self._conns = None, [], []
        _LIVE_GROUPS.add(self)
        try:
            self._spawn(env.free_port())
            self.pids = self._gather(self.start_timeout, "joining the process group")
        except BaseException:
            self._stop_all("it failed to start")
            raise

    def _spawn(self, port: int) -> None:
        ctx = _context()
        with _spawnable_main():
            for rank in range(self.nprocs):
                proc, conn = start_worker(ctx, rank, self.nprocs, port, self.backend, self.extra_env, rank)
                self._procs.append(proc)
                self._conns.append(conn)

    @property
    def broken(self) -> bool:
        """True once the group was torn down (or closed) and cannot run tasks any more."""
        return self._problem is not None

    def run(
        self,
        fn: Callable,
        /,
        *args: Any,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        **kwargs: Any,
    ) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the results, index = rank.

        `timeout` is in seconds (None: no limit); `heartbeat_timeout` (seconds, None: off) is how long a
        rank may stay silent: between two `heartbeat` calls, and from the task's start to its first. Raises
        `WorkerError`, `WorkerDiedError`, `WorkerTimeoutError` or `WorkerHangError`; see the module
        docstring for when the group survives.
        """
        task = f"running {_describe(fn)}"
        return self._run_payload(_dump_task(fn, args, kwargs), task, timeout, heartbeat_timeout)

    def _run_payload(
        self, payload: bytes, task: str, timeout: float | None, heartbeat_timeout: float | None = None
    ) -> list:
        if self._problem is not None:
            raise LaunchError(f"this WorkerGroup cannot run tasks: {self._problem}; create a new one")
        self.heartbeats = {}
        self._task_started = time.monotonic()
        try:
            for rank, conn in enumerate(self._conns):
                self._send_task(rank, conn, payload)
            return self._gather(timeout, task, heartbeat_timeout)
        except LaunchError:
            raise
        except BaseException:  # KeyboardInterrupt included: never leave workers mid-task behind
            self._stop_all("the caller was interrupted while a task ran")
            raise

    def _send_task(self, rank: int, conn: Connection, payload: bytes) -> None:
        try:
            conn.send_bytes(payload)
        except OSError:
            self._raise_died([rank], "receiving its task")

    def _gather(self, timeout: float | None, task: str, heartbeat_timeout: float | None = None) -> list:
        """Wait for one answer per rank and return the values, or raise the fitting LaunchError."""
        answers: dict[int, tuple[str, Any]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        in_grace = False
        while len(answers) < self.nprocs:
            pending = [r for r in range(self.nprocs) if r not in answers]
            handles = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            wake = self._remaining(deadline)
            if heartbeat_timeout is not None and not in_grace:
                wake = _BEAT_POLL_S if wake is None else min(wake, _BEAT_POLL_S)
            if not wait(handles, wake):
                if heartbeat_timeout is not None and not in_grace:
                    self._check_heartbeats(pending, heartbeat_timeout, task)
                if deadline is None or time.monotonic() < deadline:
                    continue
                break  # the deadline (or the grace period after an error) has passed
            self._read_answers(pending, answers, task)
            if not in_grace and any(kind == "error" for kind, _ in answers.values()):
                # Once a rank has raised, peers stuck in a collective with it would wait forever.
                in_grace = True
                grace_end = time.monotonic() + self.error_grace
                deadline = grace_end if deadline is None else min(deadline, grace_end)
        return self._conclude(answers, timeout, task)

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _read_answers(self, pending: list[int], answers: dict[int, tuple[str, Any]], task: str) -> None:
        dead = []
        for rank in pending:
            conn = self._conns[rank]
            try:
                while conn.poll():  # heartbeats first, then possibly the answer
                    kind, value = self._decode(rank, conn.recv_bytes())
                    if kind != "beat":
                        answers[rank] = (kind, value)
                        break
                    step, phase = value
                    self.heartbeats[rank] = Heartbeat(step, time.monotonic(), phase)
            except (EOFError, OSError):
                dead.append(rank)
                continue
            if rank not in answers and not conn.poll() and not self._procs[rank].is_alive():
                dead.append(rank)
        if dead:
            self._raise_died(dead, task)

    def _last_sign(self, rank: int) -> float:
        """When `rank` was last heard of: its last heartbeat, else the start of the task."""
        beat = self.heartbeats.get(rank)
        return beat.received if beat is not None else self._task_started

    def _check_heartbeats(self, pending: list[int], limit: float, task: str) -> None:
        """Tear the group down when a rank is silent for longer than `limit`: since its last heartbeat, or
        since the task started when it has not beaten yet (a rank that hangs while starting up)."""
        now = time.monotonic()
        beats = self.heartbeats
        silent = [r for r in pending if now - self._last_sign(r) > limit]
        if not silent:
            return
        steps = {r: beats[r].step if r in beats else None for r in silent}
        self._stop_all(f"{_ranks(silent)} hung")
        where = ", ".join(f"rank {r} {_last_heard(beats.get(r))}" for r in silent)
        raise WorkerHangError(
            f"{_ranks(silent)} sent no heartbeat for more than {limit:g} s while {task} (last heard: {where}); "
            "every worker was stopped. A rank stuck in a collective usually waits for a peer that is stuck "
            "elsewhere: the lowest last step (or start-up phase) points at it. If steps or start-up phases "
            "are just slow, raise the heartbeat timeout",
            ranks=silent,
            timeout=limit,
            last_steps=steps,
        )

    @staticmethod
    def _decode(rank: int, data: bytes) -> tuple[str, Any]:
        try:
            return pickle.loads(data)
        except Exception as exc:
            note = f"rank {rank}'s answer could not be unpickled in the caller: {_safe_str(exc)}"
            return "error", _failure(exc, note)

    def _raise_died(self, dead: list[int], task: str) -> None:
        for rank in dead:
            self._procs[rank].join(timeout=5)
        rank = dead[0]
        code = self._procs[rank].exitcode
        if code == _UNGUARDED_MAIN_EXIT and not self.pids:  # still starting: see _refuse_while_bootstrapping
            self._stop_all("the caller's script has no main guard")
            raise _unguarded_main_error()
        message = f"rank {rank} {_exit_reason(code)} while {task}"
        if rank in self.heartbeats:
            message += f" (its last heartbeat: {self.heartbeats[rank].describe()})"
        if len(dead) > 1:
            message += f" ({_ranks(dead[1:])} died too)"
        message += f"; every worker was stopped. {_death_hint(code)}"
        self._stop_all(f"{_ranks(dead)} died")
        raise WorkerDiedError(message, rank=rank, exitcode=code)

    def _conclude(self, answers: dict[int, tuple[str, Any]], timeout: float | None, task: str) -> list:
        missing = [r for r in range(self.nprocs) if r not in answers]
        errors = {r: value for r, (kind, value) in answers.items() if kind == "error"}
        if errors:
            if missing:
                self._stop_all(f"{_ranks(missing)} were stuck after an error")
            error = _worker_error(errors, missing, task, self.error_grace)
            raise error from errors[error.rank].original()
        if missing:
            self._stop_all(f"{_ranks(missing)} timed out")
            raise WorkerTimeoutError(
                f"{_ranks(missing)} did not answer within the timeout of {timeout:g} s while {task}; every "
                "worker was stopped. If the work is just slow, pass a larger timeout; if it hangs, look "
                "for a rank waiting on a collective that the other ranks never issue",
                ranks=missing,
                timeout=timeout,
            )
        return [answers[r][1] for r in range(self.nprocs)]

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Ask the workers to leave the process group and exit; kill those still alive after `timeout`."""
        if self._problem is None:
            for conn in self._conns:
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass  # already gone; _stop_all reaps it
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(timeout=self._remaining(deadline))
        self._stop_all("it was closed")

    def _stop_all(self, reason: str) -> None:
        """Terminate, kill and join every worker; afterwards the group cannot run tasks."""
        if self._problem is None:
            self._problem = reason
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        _LIVE_GROUPS.discard(self)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"broken: {self._problem}" if self._problem else "ready"
        return f"WorkerGroup(nprocs={self.nprocs}, backend={self.backend!r}, {state})"


# Groups not closed yet. multiprocessing's own exit hook joins live children, which would wait forever on
# idle workers; ours is registered after it (multiprocessing.util is imported above), so it runs first.
_LIVE_GROUPS: set[WorkerGroup] = set()


@atexit.register
def _close_live_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.close(timeout=5)


def launch(
    fn: Callable,
    nprocs: int,
    /,
    *args: Any,
    backend: str | None = None,
    timeout: float | None = None,
    seed: int | None = 0,
    **kwargs,
) -> list:
    """Run `fn(*args, **kwargs)` in `nprocs` local worker processes; return their results, index = rank.

    Each worker is one rank of an initialised process group (`backend`: None picks nccl with a GPU per
    rank, else gloo). `timeout` is in seconds for the task (None: no limit). Before `fn` runs, every rank
    calls `loom.seed(seed)`: torch, Python's `random` and NumPy draw the same numbers on every rank
    (`seed=None`: not seeded, each process draws its own). `fn` may be any function, also one defined in a
    REPL, a notebook or under the script's main guard (it is sent by value); a script that calls `launch`
    must do so under `if __name__ == "__main__":`. A worker's exception is re-raised as `WorkerError`
    naming its rank and carrying its traceback (a `sys.exit(code)` with a non-zero code too; `sys.exit(0)`
    returns None); a worker that dies raises `WorkerDiedError`, a timeout `WorkerTimeoutError`. No worker
    outlives the call. Bad arguments raise TypeError or ValueError before any process starts.
    """
    _refuse_while_bootstrapping()
    nprocs = _check_nprocs(nprocs)
    _check_call(fn, args, kwargs)
    _check_backend(backend, nprocs)
    _check_timeout(timeout)
    seed = rng.check_seed(seed, "loom.launch: seed", allow_none=True)
    # Pickle first: a function that cannot reach the workers is reported before any process starts.
    payload = _dump_task(fn, args, kwargs, seed)
    try:
        group = WorkerGroup(nprocs, backend=backend)
    except LaunchError as exc:
        raise exc.with_traceback(None) from exc.__cause__  # loom's own frames tell the user nothing
    with group:
        return group._run_payload(payload, f"running {_describe(fn)}", timeout)
