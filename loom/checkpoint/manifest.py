"""Checkpoint directories on disk: names, the manifest, atomic writes and integrity checks.

A checkpoint is a directory `step_000100/` under the checkpoint root. It is written as `.tmp_step_000100/`;
every rank checksums the files it writes as it writes them (see storage.py), and when every rank has
finished, rank 0 writes `manifest.json` (every file's size, checksum and writing rank, the step, the world
size, the mesh and the config) last, then renames the directory into place. A directory without a valid
manifest, or whose files do not match it, is never loaded: `latest_valid` skips it with a warning that
names the file and the problem, and falls back to the previous checkpoint. Verifying can be shared among
the ranks of a loading job, each checking the files one rank wrote (`verify(..., share=...)`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
# What a manifest's "kind" says: a whole training state, or model weights alone (`loom checkpoint import`).
FULL, WEIGHTS = "full", "weights"
# Files are checksummed with XXH3-128: a checkpoint guards against corruption (a flipped bit, a torn or
# truncated write), not tampering, and at some 20 GB/s per core the checksum costs a small fraction of
# writing or reading the bytes, where sha256 (under 2 GB/s) is slower than a fast disk. Manifests written
# with sha256 by earlier versions still verify: an entry names its algorithm by its key.
CHECKSUM = "xxh3_128"
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (missing or corrupt files) or could only be restored in part."""


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be loaded into this run."""


def step_dir_name(step: int) -> str:
    """`step_000100` for step 100 (sorted by name is sorted by step up to a million steps)."""
    return f"step_{step:06d}"


def temp_dir_name(step: int) -> str:
    """Where step `step` is written before it is complete (never read by a loader)."""
    return f".tmp_{step_dir_name(step)}"


def step_of(name: str) -> int | None:
    """The step in a `step_000100` directory name (None for any other name)."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def list_step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Every `step_*` directory under `root` as (step, path), oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` looks like one checkpoint (a manifest or a dcp/ in it), complete or not."""
    return (path / MANIFEST).exists() or (path / "dcp").is_dir()


def require_checkpoint(path: str | Path) -> Path:
    """`path` as one checkpoint directory (`step_000100/`); `CheckpointError` naming it and the fix when it
    is missing, a file, empty, a checkpoint root, or no checkpoint at all. Its contents are checked later."""
    path = Path(path)
    hint = "give a step_* directory under a run's checkpoint dir (`loom checkpoint ls DIR` lists them)"
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory; {hint}")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory; {hint}")
    if is_checkpoint_dir(path):
        return path
    steps = list_step_dirs(path)
    if steps:
        raise CheckpointError(
            f"{path}: is a checkpoint root (it holds step_* checkpoints), not one checkpoint; give one of "
            f"them, e.g. {steps[-1][1]}, or use what takes a root and picks the newest intact one "
            "(load_checkpoint, `loom checkpoint export`)"
        )
    if not any(path.iterdir()):
        raise CheckpointError(f"{path}: is empty, not a checkpoint; {hint}")
    raise CheckpointError(f"{path}: not a loom checkpoint (no {MANIFEST}, no dcp/); {hint}")


def require_root(root: str | Path) -> Path:
    """`root` as a checkpoint root (the directory holding `step_*` checkpoints; missing or empty is fine:
    no checkpoint yet); `CheckpointError` naming it and the fix when it is a file or one checkpoint."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"{root}: is a file, not a checkpoint directory; give the directory that holds (or will hold) "
            "the step_* checkpoints (the [checkpoint] dir), not a file inside it"
        )
    if root.is_dir() and is_checkpoint_dir(root):
        raise CheckpointError(
            f"{root}: is one checkpoint, not a checkpoint root; give its parent {root.parent} to resume from "
            f"the newest intact checkpoint there, or load_from({str(root)!r}) to load this one"
        )
    return root


def hasher(algorithm: str = CHECKSUM) -> Any:
    """A fresh running checksum (`update(bytes)`, `hexdigest()`)."""
    return _HASHERS[algorithm]()


def checksum_of(path: Path, algorithm: str = CHECKSUM, block: int = 1 << 20) -> str:
    """The hex checksum of a file: hashed where it lies in the page cache (mapped, read-only), or read in
    1 MiB blocks into one buffer where it cannot be mapped (an empty file, a file system without mmap)."""
    digest = hasher(algorithm)
    with open(path, "rb", buffering=0) as file:
        try:
            # no copy into a buffer first: a copy costs more than XXH3 itself. Checkpoint files are written
            # once, under a temporary name, so none shrinks while it is hashed (which would fault)
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if hasattr(mmap, "MADV_SEQUENTIAL"):
                    mapped.madvise(mmap.MADV_SEQUENTIAL)
                digest.update(mapped)
                return digest.hexdigest()
        except (OSError, ValueError):  # ValueError: an empty file cannot be mapped
            pass
        buffer = bytearray(block)  # small enough to stay in cache between the read and the hash
        view = memoryview(buffer)
        while count := file.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file, fsync, rename: readers see all of it or nothing."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def file_entry(size: int, checksum: str, rank: int) -> dict[str, Any]:
    """One file of the manifest's table: its size, checksum (`CHECKSUM`) and the rank that wrote it."""
    return {"size": size, CHECKSUM: checksum, "rank": rank}


def write_manifest(
    directory: Path, info: dict[str, Any], files: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Write the manifest: `info` plus the file table `files` (by path relative to `directory`, as the ranks
    that wrote them reported them: `file_entry`); None: checksum every file under `directory` here (one
    process wrote them all)."""
    if files is None:
        files = {
            path.relative_to(directory).as_posix(): file_entry(path.stat().st_size, checksum_of(path), 0)
            for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
        }
    manifest = {"format": FORMAT_VERSION, **info, "files": dict(sorted(files.items()))}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def publish(temp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place; an existing `final` (a re-run of the same step,
    perhaps a corrupt one) is moved aside first and removed only once the new one is in place."""
    old = final.with_name(f".old_{final.name}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(temp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The parsed manifest of a checkpoint directory; `CheckpointError` saying what is wrong otherwise."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the save did not finish); use an earlier step_* checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt or truncated JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: not a loom checkpoint manifest (no file table)")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this loom reads {FORMAT_VERSION}")
    for name, entry in manifest["files"].items():
        problem = _entry_problem(name, entry)
        if problem is not None:
            raise CheckpointError(f"{path}: not a loom checkpoint manifest ({problem})")
    return manifest


def _entry_problem(name: str, entry: Any) -> str | None:
    """What is wrong with one entry of a manifest's file table (None: nothing): a file outside the
    checkpoint directory would have verification read any file on the machine."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or ":" in parts[0] or any(part in ("", ".", "..") for part in parts):
        return f"file {name!r} is not a path inside the checkpoint"
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("size"), int)
        or isinstance(entry["size"], bool)
    ):
        return f"the entry of {name!r} has no size in bytes"
    return None


def verify(directory: str | Path, checksums: bool = True, share: tuple[int, int] | None = None) -> list[str]:
    """Problems with one checkpoint directory (empty: intact): the manifest, then every file it lists
    (present, size, and with `checksums` its checksum). Each problem names the file. `share=(i, n)`: only the
    files written by ranks `r` with `r % n == i` (the part of loading rank `i` of `n`)."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    for name, entry in manifest["files"].items():
        if share is not None and int(entry.get("rank", 0)) % share[1] != share[0]:
            continue
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {entry['size']}")
        elif checksums and _checksum_differs(path, entry):
            problems.append(f"{path}: checksum mismatch (corrupt)")
    return problems


def _checksum_differs(path: Path, entry: dict[str, Any]) -> bool:
    """Whether the file's checksum differs from the manifest's (an entry without one this loom knows: yes)."""
    algorithm = next((name for name in _HASHERS if name in entry), None)
    return algorithm is None or checksum_of(path, algorithm) != entry[algorithm]


@dataclass(frozen=True)
class Choice:
    """The checkpoint a loader picked (None: no usable one) and why the newer ones were skipped."""

    step: int | None
    path: Path | None
    skipped: tuple[str, ...]


def latest_valid(
    root: str | Path,
    warn: bool = True,
    check: Callable[[Path], list[str]] = verify,
    candidates: list[tuple[int, Path]] | None = None,
) -> Choice:
    """The newest intact checkpoint under `root` (or among `candidates`, `list_step_dirs`'s), verifying
    newest first with `check` (`verify` by default); each skipped one is reported (a `CheckpointWarning`
    naming the file and the problem, with `warn`)."""
    skipped = []
    for step, path in reversed(list_step_dirs(root) if candidates is None else candidates):
        problems = check(path)
        if not problems:
            return Choice(step, path, tuple(skipped))
        message = f"checkpoint {path.name} is unusable, falling back to the previous one: " + "; ".join(
            problems
        )
        skipped.append(message)
        if warn:
            warnings.warn(message, CheckpointWarning, stacklevel=2)
    return Choice(None, None, tuple(skipped))


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` step directories, and stale temporary ones; return what went."""
    root = Path(root)
    removed = [path for _, path in list_step_dirs(root)[:-keep_last]] if keep_last > 0 else []
    removed += [p for p in root.glob(".tmp_step_*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
