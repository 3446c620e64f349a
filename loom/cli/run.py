"""`loom run`: run a script on N local worker processes, one rank each, like torchrun."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import runpy
import sys
from collections.abc import Callable, Iterator

import torch.distributed as dist

from loom.dist.launch import LaunchError, WorkerError, launch

NAME = "run"
HELP = "run a script on N local ranks, like torchrun"
DESCRIPTION = """\
Run SCRIPT on N local worker processes, one rank each, the way torchrun would.

examples:
  loom run -n 2 train.py
  loom run -n 4 --backend gloo train.py --lr 3e-4 --steps 10
  loom run -n 8 --timeout 600 examples/demo.py

In every worker RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are set, sys.argv is
[SCRIPT, ARGS...] and the script runs as __main__. The default process group is already initialised
when the script starts: loom.init() then only builds the mesh, and a torchrun script's own
torch.distributed.init_process_group(...) call is accepted as is (it joins the group already there,
when its backend, world size and rank agree). Every rank seeds torch, random and NumPy with --seed
(default 0) first, so random tensors are the same on every rank; --seed none leaves them unseeded.

exit status: 0 when every rank succeeds; 1 when a rank raises, dies or times out (its rank and
traceback go to stderr); the script's own status when it calls sys.exit with one.
"""


def _positive(convert: Callable[[str], float], wrong_type: str, not_positive: str) -> Callable[[str], float]:
    """An argparse type: `convert(text)`, which must be > 0; each error names the text and an example."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wrong_type}; got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{not_positive}; got {text}")
        return value

    return parse


_positive_int = _positive(
    int, "must be a whole number of ranks, e.g. -n 4", "must be a positive number of ranks, e.g. -n 4"
)
_positive_seconds = _positive(
    float,
    "must be a number of seconds, e.g. --timeout 600",
    "must be a positive number of seconds (leave it out for no limit)",
)


def _seed(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(
            f"must be an int between 0 and 2**64 - 1, or 'none' not to seed; got {text!r}"
        )
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    """Add `loom run`'s arguments to `parser`."""
    parser.add_argument(
        "-n", "--nprocs", type=_positive_int, default=1, metavar="N", help="ranks (default 1)"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl with a GPU per rank, else gloo",
    )
    parser.add_argument(
        "--timeout", type=_positive_seconds, default=None, metavar="S", help="stop after S seconds"
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=0,
        metavar="N",
        help="seed torch, random and NumPy with N on every rank before the script (default 0; 'none': don't)",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed on to the script")


def _exit_status(code: object) -> int:
    """The process exit status that `sys.exit(code)` would give, printing a message code like Python."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def _group_already_joined() -> Iterator[None]:
    """Inside the block, `torch.distributed.init_process_group` accepts the default group that the worker
    already joined: a torchrun script's own call returns at once when its backend, world size and rank
    agree with the group's, and fails naming the difference otherwise (instead of torch's "trying to
    initialize the default process group twice")."""
    real = dist.init_process_group
    signature = inspect.signature(real)

    @functools.wraps(real)
    def init_process_group(*args, **kwargs):
        if not dist.is_initialized():
            return real(*args, **kwargs)
        asked = signature.bind(*args, **kwargs).arguments
        have = {
            "backend": str(dist.get_backend()),
            "world_size": dist.get_world_size(),
            "rank": dist.get_rank(),
        }
        differ = []
        backend = asked.get("backend")
        if backend is not None and str(backend).lower() not in have["backend"].lower():
            differ.append(
                f"backend {backend!r} (the group's is {have['backend']!r}: pass loom run --backend {backend})"
            )
        for key in ("world_size", "rank"):
            value = asked.get(key)
            if value is not None and value != -1 and value != have[key]:
                differ.append(
                    f"{key}={value!r} (the group's is {have[key]}: loom run -n sets the world size, each rank its own RANK)"
                )
        if differ:
            raise ValueError(
                "torch.distributed.init_process_group was called under `loom run`, which already joined "
                f"every rank to the default process group, but asks for {'; '.join(differ)}. Drop the call "
                "(or call loom.init()), or make it agree with the group"
            )
        return None

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = real


def run_script(path: str, argv: list[str]) -> int:
    """Run `path` as `python path *argv` would, in this process; return its exit status.

    This is what every worker of `loom run` executes; it is module-level so that it pickles by name.
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    # `python script.py` puts the script's folder first on sys.path; scripts import their neighbours.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with _group_already_joined():
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc.code)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _script_problem(script: str) -> str | None:
    """Why `script` cannot be run (checked before any process starts), or None."""
    if os.path.isdir(script):
        return (
            f"{script} is a directory, not a Python script; name the .py file to run "
            f"(e.g. loom run -n 2 {os.path.join(script, 'train.py')})"
        )
    if not os.path.exists(script):
        return f"script not found: {script} (no such file; nothing was started)"
    if not script.endswith(".py"):
        hint = f"; to train from a config file run `loom train {script}`" if script.endswith(".toml") else ""
        return f"{script} is not a Python script (loom run runs a .py file on every rank){hint}"
    if not os.access(script, os.R_OK):
        return f"cannot read {script} (permission denied); nothing was started"
    return None


def execute(args: argparse.Namespace) -> int:
    """Run the script on every rank; return the exit status of `loom run`."""
    problem = _script_problem(args.script)
    if problem is not None:
        print(f"loom run: error: {problem}", file=sys.stderr)
        return 2
    try:
        statuses = launch(
            run_script,
            args.nprocs,
            args.script,
            list(args.args),
            backend=args.backend,
            timeout=args.timeout,
            seed=args.seed,
        )
    except (TypeError, ValueError) as exc:  # an argument refused before any process started
        print(f"loom run: error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"loom run: {args.script} failed on rank {exc.rank}\n{exc}", file=sys.stderr)
        return 1
    except LaunchError as exc:
        print(f"loom run: {exc}", file=sys.stderr)
        return 1
    for rank, status in enumerate(statuses):
        if status != 0:
            print(f"loom run: rank {rank} exited with status {status}", file=sys.stderr)
            return status
    return 0
