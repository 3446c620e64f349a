"""Checkpoint files: written once, hashed as they are written, read straight into place.

`HashingWriter` is DCP's `FileSystemWriter` whose streams feed each written block to the manifest's checksum
(`manifest.CHECKSUM`) on its way to the file, so each rank knows the size and checksum of every file it wrote (its DCP shard, and on the
coordinator DCP's `.metadata`) when the write ends: the manifest is assembled from what the ranks report,
with no second pass over the data. A write can be stopped (`stop`): its next block raises `SaveStopped`.
`write_hashed` does the same for loom's own small files.

`DirectReader` is DCP's `FileSystemReader` (loom's `safe.SafeReader`: metadata read without running code) that reads a saved tensor's bytes straight into the tensor that
receives them (one copy from the page cache), where DCP's reader deserialises each item into a new tensor
and copies that. The files are DCP's own format (each item a `torch.save` archive): any reader reads them.
It unpickles nothing that could run code: its parser of an item's pickled layout admits a plain tensor only,
and the items it leaves to DCP's reader are read with torch's weights-only unpickler.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import io
import math
import os
import pickle
import struct
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from loom.checkpoint.manifest import hasher
from loom.checkpoint.safe import SafeReader, foreign, reason
from loom.dist._torch_private import storage_span

# What a rank reports for each file it wrote: (size in bytes, hex checksum).
Written = tuple[int, str]


class SaveStopped(RuntimeError):
    """A background write was stopped (training ended with an exception while it ran)."""


class _HashingStream:
    """A binary file open for writing that hashes what goes through it."""

    def __init__(self, file: Any, stop: threading.Event | None) -> None:
        self.file, self.stop = file, stop
        self.digest = hasher()
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
    """DCP's local file system, recording the size and checksum of every file written through it."""

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


@contextmanager
def archives_without_crc() -> Iterator[None]:
    """`torch.save` without its zip archive's CRC-32 inside the block (torch's public switch, restored
    after). DCP writes every item as a `torch.save` archive, whose CRC-32 costs about a third of writing it;
    the manifest's checksums, computed as the bytes go out, already cover every byte, and `torch.load` does
    not check the CRC. The switch is process-wide: synchronous saves use it, in the training thread, while
    loom's checkpoint thread is idle (`worker.settle` runs first)."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def memory_of(tensor: torch.Tensor) -> ctypes.Array:
    """A writable buffer over a contiguous CPU tensor's bytes, which keeps the tensor alive. Not a NumPy
    view: that pins the tensor's storage for good, and level 3 resizes parameter storages to free them."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    buffer = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    buffer.tensor = tensor
    return buffer


def write_hashed(path: Path, data: bytes) -> Written:
    """Write `data` to `path` and make it durable (fsync); its size and checksum."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    digest = hasher()
    digest.update(data)
    return len(data), digest.hexdigest()


# ---- reading -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Record:
    """A tensor that `torch.save` stored whole and contiguous: where its bytes start in the file, its size."""

    start: int
    size: tuple[int, ...]
    nbytes: int


class DirectReader(SafeReader):
    """DCP's `FileSystemReader` (metadata read safely: `SafeReader`), reading each saved tensor's bytes straight into its destination when the
    part it needs is one contiguous run of both (the common case: the same layout, or a layout cut along
    the first dim); other items go through DCP's own path."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.dtypes = {
            key: meta.properties.dtype
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[ReadItem, int, int]]] = {}
        others = []
        for item in plan.items:
            path, offset, length, transformed = storage_span(self.storage_data[item.storage_index])
            if item.type == LoadItemType.BYTE_IO or transformed:
                others.append(item)
            else:
                by_file.setdefault(path, []).append((item, offset, length))
        for path, items in by_file.items():
            with open(Path(self.path) / path, "rb", buffering=0) as file:
                records: dict[int, _Record | None] = {}
                for item, offset, length in sorted(items, key=lambda entry: entry[1]):
                    if offset not in records:
                        records[offset] = _record(file, offset, length)
                    saved = self.dtypes.get(item.storage_index.fqn)
                    if not _read_into(file, records[offset], saved, item, planner):
                        others.append(item)
        if others:
            try:
                return super().read_data(dataclasses.replace(plan, items=others), planner)
            except pickle.UnpicklingError as exc:  # torch's weights-only unpickler refused an item
                raise foreign(self.path, f"a saved item: {reason(exc)}") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_into(
    file: Any, record: _Record | None, saved: torch.dtype | None, item: ReadItem, planner: LoadPlanner
) -> bool:
    """Read the part of `record` (of dtype `saved`) that `item` asks for into its destination, if both are
    one contiguous run of the same dtype; False (nothing read) otherwise."""
    if record is None:
        return False
    target = planner.resolve_tensor(item).detach()
    run = _contiguous_run(record.size, tuple(item.storage_offsets), tuple(item.lengths))
    if run is None or target.dtype != saved or target.device.type != "cpu" or not target.is_contiguous():
        return False
    first, count = run
    size = target.element_size()
    if count != target.numel() or record.nbytes != math.prod(record.size) * size:
        return False
    buffer = memoryview(memory_of(target)).cast("B")
    file.seek(record.start + first * size)
    done = 0
    while done < len(buffer):
        got = file.readinto(buffer[done:])
        if not got:
            raise OSError(f"{file.name}: ends before the {len(buffer)} bytes of {item.storage_index.fqn}")
        done += got
    planner.commit_tensor(item, target)
    return True


def _contiguous_run(
    size: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[int, int] | None:
    """(first element, element count) of the box (`offsets`, `lengths`) of a C-ordered tensor of `size`
    when it is one contiguous run: ones, then any length, then whole dims. None otherwise."""
    dims = len(size)
    split = 0
    while split < dims and lengths[split] == 1:
        split += 1
    if any(lengths[d] != size[d] for d in range(split + 1, dims)):
        return None
    first = 0
    for d in range(dims):
        first = first * size[d] + offsets[d]
    return first, math.prod(lengths)


def _record(file: Any, offset: int, length: int) -> _Record | None:
    """The tensor `torch.save` wrote at [offset, offset + length) of `file`, when it is a plain tensor whose
    storage holds exactly its elements in C order, little-endian as this machine; None otherwise (and for
    any archive this small reader of the zip format does not expect: DCP's own path reads those)."""
    try:
        window = _Window(file, offset, length)
        entries = _archive_entries(window)
        if entries is None or sys.byteorder != "little":
            return None
        storages = [name for name in entries if "/data/" in name]
        pickled = [name for name in entries if name.endswith("/data.pkl")]
        order = [name for name in entries if name.endswith("/byteorder")]
        if len(storages) != 1 or len(pickled) != 1:
            return None
        if order and _member(window, entries[order[0]]) != b"little":
            return None
        layout = _TensorLayout(io.BytesIO(_member(window, entries[pickled[0]]))).load()
        header, method, size = entries[storages[0]]
        start = _member_start(window, header)
    except Exception:  # not what DCP's writer makes of a plain tensor: DCP's own path reads it
        return None
    if method != zipfile.ZIP_STORED or not isinstance(layout, tuple):
        return None
    storage_offset, shape, stride = layout
    if storage_offset != 0 or stride != _contiguous_strides(shape):
        return None
    return _Record(offset + start, shape, size)


# The zip records `torch.save` writes (see the zip format's APPNOTE): end of central directory, central
# directory entry, local file header.
_END = struct.Struct("<4s4H2LH")
_ENTRY = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_FULL = 0xFFFFFFFF  # a field moved to a zip64 record: not read here


def _archive_entries(window: _Window) -> dict[str, tuple[int, int, int]] | None:
    """name -> (local header offset, compression method, size) of every member, from the central directory
    at the end of the archive; None for what is not plain (zip64 fields, a long directory)."""
    tail_length = min(window.length, _EDGE)
    tail = window.read(window.length - tail_length, tail_length)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + _END.size > len(tail):
        return None
    count, directory_size, directory = _END.unpack_from(tail, end)[4:7]
    position = directory - (window.length - tail_length)
    if _FULL in (directory_size, directory) or position < 0:
        return None
    entries = {}
    for _ in range(count):
        fields = _ENTRY.unpack_from(tail, position)
        if fields[0] != b"PK\x01\x02" or _FULL in (fields[9], fields[16]):
            return None
        name_length, extra_length, comment_length = fields[10:13]
        name = tail[position + _ENTRY.size : position + _ENTRY.size + name_length].decode()
        entries[name] = (fields[16], fields[4], fields[9])
        position += _ENTRY.size + name_length + extra_length + comment_length
    return entries


def _member_start(window: _Window, header: int) -> int:
    """Where a member's bytes start: after its local header, its name and its extra field."""
    fields = _LOCAL.unpack(window.read(header, _LOCAL.size))
    if fields[0] != b"PK\x03\x04":
        raise ValueError("not a local file header")
    return header + _LOCAL.size + fields[9] + fields[10]


def _member(window: _Window, entry: tuple[int, int, int]) -> bytes:
    """A small stored member's bytes."""
    header, method, size = entry
    if method != zipfile.ZIP_STORED:
        raise ValueError("compressed member")
    return window.read(_member_start(window, header), size)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


class _TensorLayout(pickle.Unpickler):
    """Unpickles `torch.save`'s data.pkl of one plain tensor as (storage offset, size, stride), touching
    no storage; any other content raises."""

    def persistent_load(self, pid: Any) -> Any:
        return pid

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout_of
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")


def _layout_of(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> tuple:
    return int(storage_offset), tuple(size), tuple(stride)


# How much of each end of an item `_Window` reads at once: `torch.save` puts a plain tensor's small members
# (its pickled layout, byte order) before its data and the archive's directory after it, each within a few
# hundred bytes of its end, so two reads find them all.
_EDGE = 4096


class _Window:
    """Bytes [offset, offset + length) of a file: its first and last `_EDGE` bytes read once (two `pread`s:
    no seek, and not a read per zip record), anything else on demand."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        self.file, self.offset, self.length = file, offset, length
        if length <= 2 * _EDGE:
            self.head = self.tail = _pread(file, length, offset)
            self.tail_start = 0
        else:
            self.head = _pread(file, _EDGE, offset)
            self.tail_start = length - _EDGE
            self.tail = _pread(file, _EDGE, offset + self.tail_start)

    def read(self, position: int, count: int) -> bytes:
        """Up to `count` bytes from `position` (relative to the window; fewer at its end)."""
        position = max(0, min(self.length, position))
        count = max(0, min(count, self.length - position))
        if position + count <= len(self.head):
            return self.head[position : position + count]
        if position >= self.tail_start:
            return self.tail[position - self.tail_start : position - self.tail_start + count]
        return _pread(self.file, count, self.offset + position)


def _pread(file: Any, count: int, position: int) -> bytes:
    """`count` bytes of `file` from `position` (fewer at its end), without moving its position where the
    OS reads at an offset (`os.pread`), else by a seek and a read."""
    if hasattr(os, "pread"):
        return os.pread(file.fileno(), count, position)
    file.seek(position)
    return file.read(count)
