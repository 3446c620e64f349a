"""`loom run`: run a script on N local worker processes, one rank each, like torchrun."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

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
when the script starts: call loom.init() (which then only builds the mesh), not
torch.distributed.init_process_group.

exit status: 0 when every rank succeeds; 1 when a rank raises, dies or times out (its rank and
traceback go to stderr); the script's own status when it calls sys.exit with one.
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
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
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="stop after S seconds")
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


def run_script(path: str, argv: list[str]) -> int:
    """Run `path` as `python path *argv` would, in this process; return its exit status.

    This is what every worker of `loom run` executes; it is module-level so that it pickles by name.
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    # `python script.py` puts the script's folder first on sys.path; scripts import their neighbours.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc.code)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def execute(args: argparse.Namespace) -> int:
    """Run the script on every rank; return the exit status of `loom run`."""
    if not os.path.isfile(args.script):
        print(
            f"loom run: error: script not found: {args.script} (no such file; nothing was started)",
            file=sys.stderr,
        )
        return 2
    try:
        statuses = launch(
            run_script, args.nprocs, args.script, list(args.args), backend=args.backend, timeout=args.timeout
        )
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
