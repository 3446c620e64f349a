"""Checkpoint files written once: every rank hashes the bytes it writes as it writes them.

`HashingWriter` is DCP's `FileSystemWriter` whose streams feed each written block to a sha256 on its way to
the file, so each rank knows the size and checksum of every file it wrote (its DCP shard, and on the
coordinator DCP's `.metadata`) when the write ends: the manifest is assembled from what the ranks report,
with no second pass over the data. A write can be stopped (`stop`): its next block raises `SaveStopped`.
`write_hashed` does the same for loom's own small files.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

# What a rank reports for each file it wrote: (size in bytes, hex sha256).
Written = tuple[int, str]


class SaveStopped(RuntimeError):
    """A background write was stopped (training ended with an exception while it ran)."""


class _HashingStream:
    """A binary file open for writing that hashes what goes through it."""

    def __init__(self, file: Any, stop: threading.Event | None) -> None:
        self.file, self.stop = file, stop
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        if self.stop is not None and self.stop.is_set():
            raise SaveStopped("the checkpoint write was stopped")
        view = memoryview(data).cast("B")
        self.digest.update(view)  # releases the GIL on large blocks, as the write does
        written = self.file.write(view)
        self.size += written
        return written

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and sha256 of every file written through it."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        super().__init__()
        self.stop = stop
        self.written: dict[Path, Written] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with path.open(mode) as file:
            stream = _HashingStream(file, self.stop)
            yield stream
        self.written[path] = (stream.size, stream.digest.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        if Path(path) in self.written:  # DCP writes `.metadata` under a temporary name first
            self.written[Path(new_path)] = self.written.pop(Path(path))


class HashingWriter(FileSystemWriter):
    """DCP's `FileSystemWriter` (one file per rank, fsynced) that hashes what it writes: `written(root)`."""

    def __init__(self, path: str | os.PathLike, stop: threading.Event | None = None) -> None:
        super().__init__(path)
        self.fs = HashingFileSystem(stop)

    def written(self, root: Path) -> dict[str, Written]:
        """The files this rank wrote, by path relative to `root`."""
        return {path.relative_to(root).as_posix(): entry for path, entry in self.fs.written.items()}


def write_hashed(path: Path, data: bytes) -> Written:
    """Write `data` to `path` and make it durable (fsync); its size and sha256."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    return len(data), hashlib.sha256(data).hexdigest()
