"""The Python packages `benchmarks/gpu_step.py` imports besides torch, checked before torch and loom load.

The GPU machine runs the script with its own interpreter and torch, no network and no `make setup`. What
it lacks of `REQUIRED` is installed from a wheel folder carried with the checkout (`--wheels DIR`, which
`make gpu-wheels` fills: `pip install --no-index --find-links DIR NAME...`); without one the script stops
at once, naming what is missing and how to bring it, rather than spending GPU time to fail at the first
part that imports it. Standard library only: it must run where loom's dependencies are not installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# What the script's parts import besides torch (read off a `--smoke` run, its workers and its equivalence
# subprocess included; the full run takes the same paths): numpy (loom.dist.rng and the checkpoint
# state), cloudpickle (loom.launch), safetensors (loom.checkpoint), xxhash (the checkpoint manifest).
# loom's other dependencies stay out: rich, scipy and matplotlib are imported only by the command line,
# the planner's solver and the timeline plots, none of which the script reaches. Each entry is both the
# distribution's name (for pip) and its module's (for the import check).
REQUIRED = ("numpy", "cloudpickle", "safetensors", "xxhash")

MISSING_EXIT = 3  # gpu_step's exit status when a dependency is missing and cannot be installed


def missing(names: Sequence[str] = REQUIRED) -> list[str]:
    """The names of `names` that this interpreter cannot import (found without importing them)."""
    importlib.invalidate_caches()  # a package installed a moment ago is seen
    return [name for name in names if importlib.util.find_spec(name) is None]


def install_command(names: Sequence[str], wheels: Path, python: str = sys.executable) -> list[str]:
    """The pip command that installs `names` from the wheel folder `wheels` alone (no index, no network);
    pip takes their own requirements from the same folder or from what is installed."""
    return [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *names]


def add_argument(parser: argparse.ArgumentParser) -> None:
    """`--wheels DIR` on `parser` (gpu_step's own parser and the early one here share it)."""
    parser.add_argument(
        "--wheels",
        type=Path,
        metavar="DIR",
        help="a folder of wheels (`make gpu-wheels` fills .gpu-wheels/) to install missing dependencies from",
    )


def _message(names: Sequence[str], reason: str) -> str:
    return (
        f"gpu_step: missing Python packages: {', '.join(names)} ({reason}). On a machine with network, "
        "`make gpu-wheels` downloads them into .gpu-wheels/; carry that folder and pass `--wheels "
        ".gpu-wheels` (docs/gpu.md gives the whole call), or install them with pip."
    )


def ensure(wheels: Path | None, names: Sequence[str] = REQUIRED) -> None:
    """Install what is missing of `names` from `wheels`; exit with `MISSING_EXIT` and a message naming
    the packages when that is impossible (no folder, or pip fails, or they are still missing after)."""
    absent = missing(names)
    if not absent:
        return
    if wheels is None:
        print(_message(absent, "no --wheels folder given"), file=sys.stderr)
        sys.exit(MISSING_EXIT)
    if not wheels.is_dir():
        print(_message(absent, f"--wheels {wheels} is not a folder"), file=sys.stderr)
        sys.exit(MISSING_EXIT)
    command = install_command(absent, wheels)
    print(f"gpu_step: installing {', '.join(absent)} from {wheels}: {' '.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    still = missing(names)
    if done.returncode != 0 or still:
        tail = (done.stderr or done.stdout)[-1500:]
        print(_message(still or absent, f"pip install from {wheels} failed:\n{tail}"), file=sys.stderr)
        sys.exit(MISSING_EXIT)


def ensure_from_argv(argv: Sequence[str]) -> None:
    """`ensure` with the `--wheels` of a command line whose other arguments are parsed later."""
    parser = argparse.ArgumentParser(add_help=False)
    add_argument(parser)
    known, _ = parser.parse_known_args(argv)
    ensure(known.wheels)


CARRY_LIMIT = 64 * 2**20  # the device tool's limit on the working tree and carried paths together


def tree_bytes(root: Path) -> int:
    """Bytes of the files git would send from `root` (tracked, and untracked but not ignored)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = (root / name for name in listed.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    """`names`: print `REQUIRED` (for `make gpu-wheels`); `size DIR`: the carry's size (the working tree
    plus DIR) against the device tool's limit, exit status 1 above it."""
    parser = argparse.ArgumentParser(description="gpu_step's dependencies: names, and the carry's size")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("names", help="the packages gpu_step needs besides torch, one line")
    size = sub.add_parser("size", help="the working tree plus DIR, against the 64 MiB carry limit")
    size.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "names":
        print(" ".join(REQUIRED))
        return 0
    root = Path(__file__).resolve().parents[1]
    tree, wheels = tree_bytes(root), folder_bytes(args.folder)
    total = tree + wheels
    print(
        f"{args.folder}: {wheels / 2**20:.1f} MiB; with the working tree ({tree / 2**20:.1f} MiB) "
        f"{total / 2**20:.1f} MiB of the device tool's {CARRY_LIMIT / 2**20:.0f} MiB"
    )
    return 0 if total <= CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
