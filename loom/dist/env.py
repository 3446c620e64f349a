"""Process-group set-up: one entry point that works wherever a loom program starts.

`ensure_process_group` initialises the default `torch.distributed` process group from whatever the
environment offers: loom's own launcher and `loom run` (which set torchrun's variables), plain `torchrun`,
or a lone `python` process with none of those variables (then a 1-rank group on 127.0.0.1, so that code
written for many ranks runs unchanged on one). No mesh logic lives here.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import socket

import torch
import torch.distributed as dist

__all__ = [
    "DEVICE_CHOICES",
    "backend_for",
    "collective_timeout",
    "device_type",
    "ensure_process_group",
    "free_port",
    "local_rank",
    "rank",
    "resolve_device",
    "restart_count",
    "shutdown_process_group",
    "world_size",
]

# The variables torchrun sets; loom's launcher sets the same ones so that user code reads them alike.
_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Long enough for slow peers to reach the final barrier, short enough that exit never hangs for long.
_SHUTDOWN_BARRIER_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def _default_backend(local: int) -> str:
    # NCCL only when every rank on this machine has a GPU of its own: all ranks must choose the same backend.
    return "nccl" if _gpu_per_rank(local) else "gloo"


def _gpu_per_rank(local: int | None = None, nprocs: int | None = None) -> bool:
    """Whether every rank on this machine has a GPU of its own: `nprocs` ranks (default: LOCAL_WORLD_SIZE,
    set by torchrun and loom, and at least this process's LOCAL_RANK + 1)."""
    local = _env_int("LOCAL_RANK", 0) if local is None else local
    ranks_here = nprocs if nprocs is not None else max(_env_int("LOCAL_WORLD_SIZE", 0), local + 1)
    return _gpu_count() >= max(ranks_here, 1)


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# `[train] device`: where a rank computes.
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def _check_device_setting(setting: object, key: str) -> None:
    if setting not in DEVICE_CHOICES:
        raise ValueError(
            f"{key} = {setting!r}: choose 'auto' (a GPU when every rank on the machine has one, else the CPU), "
            "'cpu' or 'cuda'"
        )
    if setting == "cuda" and _gpu_count() == 0:
        raise ValueError(
            f"{key} = 'cuda' but torch {torch.__version__} sees no GPU here (CUDA build: "
            f"{torch.version.cuda or 'none'}); set {key} = 'auto' or 'cpu', or run where a GPU is"
        )


def resolve_device(setting: str = "auto", key: str = "train.device") -> torch.device:
    """The device this rank computes on, for a device setting (`key` names it in errors): "cpu"; "cuda":
    this rank's GPU (LOCAL_RANK, modulo the GPUs: ranks beyond them share, over gloo), a ValueError without
    one; "auto": "cuda" when every rank on this machine has a GPU of its own, else "cpu"."""
    _check_device_setting(setting, key)
    if setting == "cpu" or (setting == "auto" and not _gpu_per_rank()):
        return torch.device("cpu")
    return torch.device("cuda", _env_int("LOCAL_RANK", 0) % _gpu_count())


def backend_for(setting: str = "auto", nprocs: int | None = None, key: str = "train.device") -> str:
    """The process-group backend for `nprocs` local ranks computing on `setting`'s device (see
    `resolve_device`): NCCL when they compute on GPUs, one each; gloo on the CPU, and for ranks that share
    GPUs (NCCL refuses two ranks on one GPU; gloo carries CUDA tensors through host memory)."""
    _check_device_setting(setting, key)
    return "nccl" if setting != "cpu" and _gpu_per_rank(nprocs=nprocs) else "gloo"


def _rendezvous_from_env() -> bool:
    """True when torchrun-style variables are set; ValueError when only some of them are."""
    present = [name for name in _RENDEZVOUS_VARS if os.environ.get(name)]
    if not present:
        return False
    missing = [name for name in _RENDEZVOUS_VARS if name not in present]
    if missing:
        raise ValueError(
            f"found {', '.join(present)} but not {', '.join(missing)} in the environment; set all of "
            f"{', '.join(_RENDEZVOUS_VARS)} (torchrun and `loom run` do), or none for a 1-process run"
        )
    return True


def ensure_process_group(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group unless it already is.

    `timeout_s` bounds every collective (gloo and NCCL raise past it); None reads
    LOOM_COLLECTIVE_TIMEOUT_S (set by a supervised `loom train`), else 30 minutes.

    With RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (torchrun, `loom run`,
    `loom.launch` workers) the group is joined as ``init_method="env://"`` would, except that when
    MASTER_ADDR is a loopback address (every local run of loom) rank 0's rendezvous store listens on that
    address only, not on every interface. Without them this process becomes a 1-rank group on 127.0.0.1
    with a free port. When `backend` is None it is "nccl" if every
    local rank has a GPU (this process's LOCAL_RANK then becomes the current device), else "gloo".
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build that includes it")
    if dist.is_initialized():
        return
    local = _env_int("LOCAL_RANK", 0)
    backend = backend or _default_backend(local)
    if "nccl" in backend:
        torch.cuda.set_device(local)
    timeout = collective_timeout() if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if not _rendezvous_from_env():
        _join_on_loopback(backend, "127.0.0.1", 0, 0, 1, timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _join_through_agent_store(backend, timeout)
    elif (loopback := _loopback_ipv4(os.environ["MASTER_ADDR"])) is not None:
        rank_, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        _join_on_loopback(backend, loopback, _env_int("MASTER_PORT", 0), rank_, world, timeout)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    # A script under torchrun rarely tears its group down; leaving together avoids gloo's abort at exit.
    atexit.register(shutdown_process_group)


def _loopback_ipv4(host: str) -> str | None:
    """The IPv4 loopback address that MASTER_ADDR `host` spells ("127.0.0.1", "localhost"), else None.

    Literal addresses only: a host name that merely resolves to a loopback address here (Debian maps the
    machine's name to 127.0.1.1) may name this machine to the other nodes of a multi-node run.
    """
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return host if address.version == 4 and address.is_loopback else None


def _join_on_loopback(
    backend: str, host: str, port: int, rank: int, world: int, timeout: datetime.timedelta
) -> None:
    """Join the group through a rendezvous store that listens on the loopback interface only.

    `env://` makes rank 0's `TCPStore` listen on every interface (`*:MASTER_PORT`), so that another machine
    could reach the store of a run that is local by construction. Here rank 0 binds the listening socket
    to `host` itself and hands it to the store (`master_listen_fd`); the others connect as `env://` would.
    Port 0 (a 1-process group) lets the OS pick the port. A port taken meanwhile raises OSError
    EADDRINUSE, which the launcher retries on another port.
    """
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(128, world))
        except BaseException:
            listener.close()
            raise
        port = listener.getsockname()[1]
        # The store owns the descriptor from here on (it closes it when it is destroyed).
        store = dist.TCPStore(
            host, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach()
        )
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    # The key prefix `env://` uses, so that the group sees the store exactly as it would under env://.
    store = dist.PrefixStore("default_pg", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _join_through_agent_store(backend: str, timeout: datetime.timedelta) -> None:
    """Join through the store torchrun's agent hosts, under a prefix of this attempt's own.

    The agent keeps its store across restarts (`--max-restarts`), and `env://` reads the ranks' addresses
    under the same keys every attempt: a restarted rank can read a dead peer's address and fail to connect
    ("Connection refused"). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps attempts apart.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    store_prefix = f"loom/attempt_{restart_count()}"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(store_prefix, store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )


def rank() -> int:
    """This process's global rank (0 when no process group is initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 when no process group is initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def collective_timeout() -> datetime.timedelta:
    """How long one collective may wait: LOOM_COLLECTIVE_TIMEOUT_S (set by a supervised `loom train`), else
    30 minutes."""
    return datetime.timedelta(seconds=float(os.environ.get("LOOM_COLLECTIVE_TIMEOUT_S") or 1800))


def restart_count() -> int:
    """How many times this job has been restarted after a failure (TORCHELASTIC_RESTART_COUNT, which torchrun
    and loom's supervisor set; 0 on the first attempt)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK; 0 when no process group is initialised)."""
    return _env_int("LOCAL_RANK", 0) if dist.is_initialized() else 0


def device_type() -> str:
    """The device kind the process group's collectives run on: "cuda" with NCCL, else "cpu".

    Before initialisation it is the kind `ensure_process_group()` would choose.
    """
    backend = str(dist.get_backend()) if dist.is_initialized() else _default_backend(local_rank())
    return "cuda" if "nccl" in backend else "cpu"


def shutdown_process_group() -> None:
    """Wait for every rank (bounded), then destroy the default process group; a no-op when none exists.

    The barrier is there because with torch 2.13 and gloo a rank that destroys its group while peers are
    still tearing theirs down sometimes aborts at exit ("terminate called without an active
    exception"). Barrier errors are swallowed: a peer that already died must not stop this one exiting.
    """
    if not dist.is_initialized():
        return
    # NCCL needs the device named, or it guesses one and warns.
    device_ids = [torch.cuda.current_device()] if "nccl" in str(dist.get_backend()) else None
    try:
        work = dist.barrier(async_op=True, device_ids=device_ids)
        work.wait(timeout=datetime.timedelta(seconds=_SHUTDOWN_BARRIER_S))
    except Exception:
        pass  # best effort by design, see the docstring
    dist.destroy_process_group()
