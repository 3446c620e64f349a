"""Reading checkpoint files without running code from them.

A checkpoint may come from elsewhere (downloaded, copied from a shared disk), and its manifest proves only
that the files are the ones it lists: whoever writes the files can write the manifest too. So nothing loom
reads from a checkpoint can run code:

- DCP's `.metadata`, which torch's `FileSystemReader` reads with a plain `pickle.load`, is read by
  `read_metadata` here: an unpickler that admits only DCP's metadata classes, `torch.Size`, dtypes and
  layouts, and then checks what it built (every storage file a plain name inside `dcp/`). `SafeReader` is
  DCP's reader with that metadata reader; loom reads every checkpoint through it.
- Python values DCP saved (optimizer settings), which DCP's default planner reads with
  `torch.load(weights_only=False)`, are read with `weights_only=True` (`SafeLoadPlanner`); saved tensors
  already are (torch's reader, or loom's `storage.DirectReader`, whose own parser admits a plain tensor only).
- loom's side files (`train_state.pt`, `rank_*.pt`) and imported `.pt` files: `load_torch_file`, torch's
  weights-only unpickler.

Any other content is a `CheckpointError` naming the file and saying that it holds something other than
checkpoint data; nothing in it has run. torch's DCP has no safe-load option of its own (torch 2.11-2.13).
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from loom.checkpoint.manifest import CheckpointError
from loom.dist._torch_private import dcp_metadata_private_globals, set_nested

METADATA = ".metadata"  # DCP's metadata file in a checkpoint's dcp/

# The classes a DCP `.metadata` pickle names, and what each (module, name) becomes: these only hold data
# (dataclasses, an enum, torch.Size); a checkpoint path is rebuilt as a pure path (never touches the disk).
_METADATA_CLASSES: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    },
    **dcp_metadata_private_globals(),
    ("torch", "Size"): torch.Size,
    **{
        (module, name): pure
        for module in ("pathlib", "pathlib._local")
        for name, pure in (
            ("PosixPath", pathlib.PurePosixPath),
            ("PurePosixPath", pathlib.PurePosixPath),
            ("WindowsPath", pathlib.PureWindowsPath),
            ("PureWindowsPath", pathlib.PureWindowsPath),
        )
    },
}

_STORAGE_INFO = _METADATA_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")]

TRUST_NOTE = "loom never runs code from checkpoint files, so it does not load this one"
DAMAGED = (
    "if you made this checkpoint, it is damaged or was changed: use an earlier one "
    "(`loom checkpoint verify DIR` checks them)"
)


def foreign(path: Path | str, found: str, fix: str = DAMAGED) -> CheckpointError:
    """The error for a file that holds something other than checkpoint data."""
    return CheckpointError(
        f"{path}: holds something other than checkpoint data ({found}); {TRUST_NOTE}; {fix}"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata; any other global (a function to call, a class to build) raises."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is no part of DCP's metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to objects outside the file")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata from the file `path` (a checkpoint's `dcp/.metadata`), unpickling nothing but its
    classes, and checked: `CheckpointError` naming the file for anything else."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (DCP's metadata); {DAMAGED}")
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except Exception as exc:  # any failure to unpickle (nothing but DCP's data classes was built)
        raise foreign(path, _content_hint(path) or reason(exc)) from None
    problem = _metadata_problem(metadata)
    if problem is not None:
        raise foreign(path, problem)
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    """What is wrong with what a metadata file held (None: DCP metadata that loom can use)."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(key, str)
        and isinstance(value, (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata))
        for key, value in entries.items()
    ):
        return "its state_dict_metadata is not a table of names to tensor or value entries"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "its storage_data is not a table"
    for info in storage.values():
        if not isinstance(info, _STORAGE_INFO):
            return f"a storage entry is a {type(info).__name__}"
        name = info.relative_path
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
            return f"storage file {name!r} is not a file name inside dcp/"
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            return f"storage entry of {name!r} has offset {info.offset!r}, length {info.length!r}"
    return None


def reason(exc: BaseException) -> str:
    """A short reason from an unpickling error: torch's weights-only message without its advice to load
    with `weights_only=False` (which would run the file's code)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    text = " ".join(text.split())
    text = text.split(". ")[0].rstrip(".")
    return (text[:200] + "...") if len(text) > 200 else (text or type(exc).__name__)


class SafeReader(FileSystemReader):
    """DCP's `FileSystemReader` whose metadata is read by `read_metadata` (nothing but DCP's classes)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        metadata = read_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading saved Python values with torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        what = f"the checkpoint's value {read_item.dest_index.fqn!r}"
        loaded = load_torch_file(value, what)
        if self.flatten_state_dict:
            set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_torch_file(source: Path | io.BytesIO, what: str | None = None, fix: str = DAMAGED) -> Any:
    """`torch.load(source)` on the CPU with torch's weights-only unpickler (tensors, containers, numbers,
    strings); `CheckpointError` naming `what` (default: the file) and saying `fix` for anything else, of
    which nothing has run."""
    name = what or str(source)
    if isinstance(source, Path) and not source.is_file():
        raise CheckpointError(f"{name}: missing; {fix}")
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # a crafted or damaged file can fail in many ways (KeyError, BadZipFile, ...)
        hint = _content_hint(source)
        if hint is not None:  # not a torch.save archive at all
            raise CheckpointError(f"{name}: not a torch.save file ({hint}); {fix}") from None
        if isinstance(exc, pickle.UnpicklingError):  # torch's weights-only unpickler refused it
            raise foreign(name, reason(exc), fix) from None
        raise CheckpointError(f"{name}: not a readable torch.save file ({reason(exc)}); {fix}") from None


def _content_hint(source: Path | io.BytesIO) -> str | None:
    """What a file that is not a torch.save archive looks like ("text, starting '[model]'"), or None when it
    looks like one (a zip archive or a pickle)."""
    try:
        if isinstance(source, io.BytesIO):
            head = source.getvalue()[:64]
        else:
            with open(source, "rb") as file:
                head = file.read(64)
    except OSError:
        return None
    if not head:
        return "it is empty"
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return None
    try:
        text = head.decode()
    except UnicodeDecodeError:
        return f"it starts with bytes {head[:8]!r}"
    first = text.strip().splitlines()[0] if text.strip() else text
    return f"it is text, starting {first[:40]!r}"


def check_contents(checkpoint: Path) -> tuple[list[str], list[str]]:
    """(what was checked, problems) of loading `checkpoint`'s files as loom does, without loading the
    tensors: DCP's metadata (its classes only), the torch.save side files and every Python value DCP saved
    (weights-only), plan.json (JSON). Each problem names the file. Nothing in them runs."""
    checked: list[str] = []
    problems: list[str] = []
    try:
        metadata = read_metadata(checkpoint / "dcp" / METADATA)
    except CheckpointError as exc:
        problems.append(str(exc))
    else:
        entries = len(metadata.state_dict_metadata)
        checked.append(f"dcp/{METADATA}: DCP metadata only ({entries} entries)")
        values = _check_values(checkpoint / "dcp", metadata, problems)
        if values:
            checked.append(f"{values} saved Python values: plain data")
    side = sorted(p for p in checkpoint.glob("*.pt") if p.is_file())
    for path in side:
        try:
            load_torch_file(path)
        except CheckpointError as exc:
            problems.append(str(exc))
    if side:
        checked.append(f"{', '.join(p.name for p in side)}: plain data (weights-only)")
    plan = checkpoint / "plan.json"
    if plan.is_file():
        try:
            json.loads(plan.read_text())
            checked.append("plan.json: JSON")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{plan}: not JSON ({exc}); {DAMAGED}")
    return checked, problems


def _check_values(dcp_dir: Path, metadata: Metadata, problems: list[str]) -> int:
    """Load every Python value (not tensor) DCP saved, weights-only; the number checked."""
    count = 0
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(entry, dcp_metadata.BytesStorageMetadata) or info.transform_descriptors:
            continue
        path = dcp_dir / info.relative_path
        try:
            with open(path, "rb") as file:
                file.seek(info.offset)
                data = file.read(info.length)
        except OSError as exc:
            problems.append(f"{path}: unreadable ({exc})")
            continue
        try:
            load_torch_file(io.BytesIO(data), f"{path} (value {index.fqn!r})")
        except CheckpointError as exc:
            problems.append(str(exc))
        count += 1
    return count
